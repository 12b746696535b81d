"""The Records world: a small in-memory record store and the deterministic task generator.

A store is ``{collection: {id: {field: value}}}`` with three entity groups:

* ``people``   (``PER-####``): name, email, city, department, age
* ``products`` (``PRD-####``): name, sku, category, price, stock
* ``orders``   (``ORD-####``): tracking, customer (a person id), product (a product id),
  status, quantity

Every task carries its own store (``TaskSpec.data``), drawn from seeded name lists, and a
``target``::

    {"answer": str,              # the expected final reply
     "diff": {coll: {id: {field: {"old": x, "new": y}}}},   # the expected store diff
     "solution": [block, ...]}   # what the scripted solver does

A solution block is ``{"item": k, "steps": [step, ...], "delegate": str | None,
"returns": str | None}``: the tool steps for item ``k`` (a step is ``{"tool", "arguments"}``
plus ``"field"`` for a ``get``). A block with ``delegate`` may be handed to a sub-agent with
``spawn(task=delegate)``; the sub-agent runs its steps and replies ``returns``.

Records tasks chain 1-4 skills (``STRUCTURES``); LongRecords tasks repeat a chain over K
entities and join the per-entity results in order (``LONG_STRUCTURES``). ``task_pool``
functions are deterministic: task ``i`` of seed ``s`` depends only on ``(s, i)``, and every
block of ``len(STRUCTURES)`` consecutive tasks holds each structure once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from envs.core import TaskMeta, TaskSpec

# ---------------------------------------------------------------------------------------------
# Seeded vocabularies and the schema
# ---------------------------------------------------------------------------------------------

FIRST_NAMES = ("Ana", "Ben", "Chloe", "Dev", "Elif", "Farid", "Greta", "Hugo", "Ines", "Jonas",
               "Kaito", "Lena", "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven",
               "Tara", "Umar", "Vera", "Wen", "Yusuf", "Zoe")
LAST_NAMES = ("Silva", "Okafor", "Novak", "Larsen", "Moreau", "Tanaka", "Haddad", "Kowalski",
              "Rossi", "Mendes", "Fischer", "Ibrahim", "Costa", "Nguyen", "Petrov", "Santos",
              "Weber", "Yilmaz", "Dubois", "Kim")
DOMAINS = ("example.com", "mail.test", "corp.example", "post.test")
CITIES = ("Lyon", "Porto", "Leeds", "Graz", "Turin", "Malmo", "Ghent", "Bergen", "Cork", "Brno",
          "Split", "Tartu", "Kyoto", "Austin", "Denver", "Quito", "Lagos", "Perth", "Dakar",
          "Hanoi")
NEW_CITIES = ("Cape Town", "La Paz", "San Jose", "New Haven", "Las Palmas", "Rio Branco",
              "Buenos Aires", "Santa Fe", "Hong Kong", "Kuala Lumpur")
DEPARTMENTS = ("Sales", "Finance", "Legal", "Support", "Research", "Logistics", "Marketing",
               "Security", "Design", "Platform")
ADJECTIVES = ("Compact", "Solar", "Rapid", "Quiet", "Smart", "Steel", "Nordic", "Urban",
              "Classic", "Mini")
NOUNS = ("Lamp", "Kettle", "Drill", "Router", "Backpack", "Speaker", "Blender", "Heater",
         "Monitor", "Scooter", "Camera", "Printer")
CATEGORIES = ("Home", "Garden", "Tools", "Audio", "Office", "Outdoor", "Kitchen", "Travel")
STATUSES = ("pending", "paid", "shipped", "delivered", "returned", "cancelled")
NEW_STATUSES = ("on hold", "in transit", "back ordered", "partly shipped")

# field kinds: text | email | code (unique identifier-like) | int | ref (another record's id)
SCHEMA: dict[str, dict[str, Any]] = {
    "people": {"prefix": "PER", "entity": "person", "fields": {
        "name": "text", "email": "email", "city": "text", "department": "text", "age": "int"}},
    "products": {"prefix": "PRD", "entity": "product", "fields": {
        "name": "text", "sku": "code", "category": "text", "price": "int", "stock": "int"}},
    "orders": {"prefix": "ORD", "entity": "order", "fields": {
        "tracking": "code", "customer": "ref", "product": "ref", "status": "text",
        "quantity": "int"}},
}
COLLECTIONS = tuple(SCHEMA)
SEARCH_KEYS = {"people": ("email", "name"), "products": ("sku", "name"), "orders": ("tracking",)}
READ_FIELDS = {"people": ("city", "department", "age", "email"),
               "products": ("category", "price", "stock", "sku"),
               "orders": ("status", "quantity", "customer", "product")}
# fields a task may write, with where new literal values come from
WRITE_FIELDS = {"people": ("city", "department", "age"),
                "products": ("category", "price", "stock"),
                "orders": ("status", "quantity")}
NEW_TEXT = {"city": NEW_CITIES, "department": DEPARTMENTS, "category": CATEGORIES,
            "status": NEW_STATUSES}

# ---------------------------------------------------------------------------------------------
# Transform ops (the `transform` tool)
# ---------------------------------------------------------------------------------------------


def _as_int(value: str) -> int:
    try:
        return int(value.strip())
    except ValueError:
        raise ValueError(f"{value!r} is not an integer") from None


def _strip_domain(value: str) -> str:
    if "@" not in value:
        raise ValueError(f"{value!r} is not an email address")
    return value.strip().split("@", 1)[0]


TRANSFORMS = {
    "upper": lambda v: v.upper(),
    "lower": lambda v: v.lower(),
    "title": lambda v: " ".join(w.capitalize() for w in v.split()),
    "strip_domain": _strip_domain,
    "increment": lambda v: str(_as_int(v) + 1),
    "double": lambda v: str(_as_int(v) * 2),
}
# ops that change a value of each kind (title is only used on lower-case literals)
OPS_FOR_KIND = {"text": ("upper", "lower"), "email": ("strip_domain", "upper"),
                "code": ("lower",), "int": ("increment", "double")}


def apply_transform(op: str, value: str) -> str:
    """Run one op; ``ValueError`` with the reason on an unknown op or a value it cannot take."""
    if op not in TRANSFORMS:
        raise ValueError(f"unknown op {op!r}; ops: {sorted(TRANSFORMS)}")
    return TRANSFORMS[op](value)


def coerce(collection: str, field: str, value: str) -> Any:
    """The typed value stored for ``value`` (a string from the agent) in ``field``."""
    return _as_int(value) if SCHEMA[collection]["fields"][field] == "int" else value


# ---------------------------------------------------------------------------------------------
# Stores and diffs
# ---------------------------------------------------------------------------------------------


def make_store(rng: np.random.Generator, size: int) -> dict[str, dict[str, dict[str, Any]]]:
    """``size`` records per collection, with unique names, emails, skus and tracking codes."""

    def ids(prefix: str) -> list[str]:
        return [f"{prefix}-{n}" for n in rng.choice(np.arange(1000, 10000), size, replace=False)]

    names = [(FIRST_NAMES[i // len(LAST_NAMES)], LAST_NAMES[i % len(LAST_NAMES)])
             for i in rng.choice(len(FIRST_NAMES) * len(LAST_NAMES), size, replace=False)]
    people = {pid: {"name": f"{first} {last}",
                    "email": f"{first}.{last}@{_pick(rng, DOMAINS)}".lower(),
                    "city": _pick(rng, CITIES), "department": _pick(rng, DEPARTMENTS),
                    "age": int(rng.integers(21, 66))}
              for pid, (first, last) in zip(ids("PER"), names, strict=True)}
    product_names = [f"{ADJECTIVES[i // len(NOUNS)]} {NOUNS[i % len(NOUNS)]}"
                     for i in rng.choice(len(ADJECTIVES) * len(NOUNS), size, replace=False)]
    skus = rng.choice(np.arange(1000, 10000), size, replace=False)
    products = {pid: {"name": name,
                      "sku": f"{_pick(rng, 'ABCDEFGHJKLMNPQRSTUVWXYZ')}"
                             f"{_pick(rng, 'ABCDEFGHJKLMNPQRSTUVWXYZ')}-{sku}",
                      "category": _pick(rng, CATEGORIES), "price": int(rng.integers(10, 500)),
                      "stock": int(rng.integers(10, 100))}
                for pid, name, sku in zip(ids("PRD"), product_names, skus, strict=True)}
    tracking = rng.choice(np.arange(10000, 100000), size, replace=False)
    orders = {oid: {"tracking": f"TRK{code}", "customer": _pick(rng, list(people)),
                    "product": _pick(rng, list(products)), "status": _pick(rng, STATUSES),
                    "quantity": int(rng.integers(10, 41))}
              for oid, code in zip(ids("ORD"), tracking, strict=True)}
    return {"people": people, "products": products, "orders": orders}


def store_diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What changed: ``{collection: {id: {field: {"old": x, "new": y}}}}`` (empty: nothing)."""
    diff: dict[str, Any] = {}
    for coll, records in after.items():
        for rid, record in records.items():
            old = before.get(coll, {}).get(rid, {})
            changed = {f: {"old": old.get(f), "new": v}
                       for f, v in record.items() if old.get(f) != v}
            if changed:
                diff.setdefault(coll, {})[rid] = changed
    return diff


def _pick(rng: np.random.Generator, options) -> Any:
    return options[int(rng.integers(len(options)))]


# ---------------------------------------------------------------------------------------------
# Steps and prompt phrases
# ---------------------------------------------------------------------------------------------


def _search(coll: str, field: str, value: Any) -> dict[str, Any]:
    return {"tool": "search",
            "arguments": {"collection": coll, "field": field, "value": str(value)}}


def _get(coll: str, rid: str, field: str) -> dict[str, Any]:
    return {"tool": "get", "arguments": {"collection": coll, "id": rid}, "field": field}


def _transform(op: str, value: Any) -> dict[str, Any]:
    return {"tool": "transform", "arguments": {"op": op, "value": str(value)}}


def _update(coll: str, rid: str, field: str, value: Any) -> dict[str, Any]:
    return {"tool": "update",
            "arguments": {"collection": coll, "id": rid, "field": field, "value": str(value)}}


def _entity(coll: str) -> str:
    return SCHEMA[coll]["entity"]


def _kind(coll: str, field: str) -> str:
    return SCHEMA[coll]["fields"][field]


class _Draw:
    """Random choices for one task over its store."""

    def __init__(self, rng: np.random.Generator, store: dict[str, Any]):
        self.rng, self.store = rng, store

    def pick(self, options):
        return _pick(self.rng, list(options))

    def record(self, coll: str) -> str:
        return self.pick(sorted(self.store[coll]))

    def records(self, coll: str, k: int) -> list[str]:
        return [str(r) for r in self.rng.choice(sorted(self.store[coll]), k, replace=False)]

    def search_key(self, coll: str) -> str:
        return self.pick(SEARCH_KEYS[coll])

    def readable(self, coll: str, kinds: tuple[str, ...] | None = None) -> str:
        return self.pick(f for f in READ_FIELDS[coll] if kinds is None or _kind(coll, f) in kinds)

    def op_for(self, coll: str, field: str, rids: list[str]) -> str:
        """An op that changes the field's value on every one of ``rids``."""
        values = [str(self.store[coll][rid][field]) for rid in rids]
        return self.pick(op for op in OPS_FOR_KIND[_kind(coll, field)]
                         if all(apply_transform(op, v) != v for v in values))

    def new_value(self, coll: str, rid: str, field: str) -> Any:
        old = self.store[coll][rid][field]
        if _kind(coll, field) == "int":
            return self.pick(v for v in range(10, 100) if v != old)
        return self.pick(v for v in NEW_TEXT[field] if v != old)


# ---------------------------------------------------------------------------------------------
# Records tasks: one chain of 1-4 skills
# ---------------------------------------------------------------------------------------------

STRUCTURES = ("search", "get", "transform", "update", "search>get", "get>transform",
              "search>update", "search>get>transform", "search>transform>update",
              "get>transform>update", "search>get>transform>update")
REPLY_VALUE = "Reply with the value only."


def _chain(structure: str, d: _Draw, coll: str) -> tuple[str, list[dict], str, dict]:
    """(prompt, steps, answer, expected diff) of one Records chain on a random record."""
    entity, rid = _entity(coll), d.record(coll)
    record = d.store[coll][rid]
    key = d.search_key(coll)
    who = f"the {entity} whose {key} is '{record[key]}'"
    find = [_search(coll, key, record[key])]

    if structure == "search":
        return (f"Find the id of {who}. Reply with the id only.", find, rid, {})
    if structure in ("get", "search>get"):
        field = d.readable(coll)
        prompt = (f"What is the {field} of {entity} {rid}?" if structure == "get"
                  else f"What is the {field} of {who}?")
        steps = ([] if structure == "get" else find) + [_get(coll, rid, field)]
        return f"{prompt} {REPLY_VALUE}", steps, str(record[field]), {}
    if structure == "transform":
        field = d.readable(coll, kinds=("text", "email", "int"))
        op, value = d.op_for(coll, field, [rid]), str(record[field])
        return (f"Use the transform tool to apply the '{op}' op to '{value}'. "
                "Reply with the result only.", [_transform(op, value)],
                apply_transform(op, value), {})
    if structure in ("get>transform", "search>get>transform"):
        field = d.readable(coll, kinds=("text", "email", "int"))
        op = d.op_for(coll, field, [rid])
        target = f"{entity} {rid}" if structure == "get>transform" else who
        steps = ([] if structure == "get>transform" else find) + [
            _get(coll, rid, field), _transform(op, record[field])]
        return (f"Read the {field} of {target} and apply the '{op}' op to it with the transform "
                "tool. Reply with the result only.", steps,
                apply_transform(op, str(record[field])), {})

    field = d.pick(WRITE_FIELDS[coll])
    if structure in ("update", "search>update"):
        new = d.new_value(coll, rid, field)
        target = f"{entity} {rid}" if structure == "update" else who
        steps = ([] if structure == "update" else find) + [_update(coll, rid, field, new)]
        return (f"Set the {field} of {target} to '{new}'. Reply with the new value only.",
                steps, str(new), _diff(coll, rid, field, record[field], new))
    if structure == "search>transform>update":
        new = d.new_value(coll, rid, field)
        if _kind(coll, field) == "int":  # the agent is given the value before the op
            op = d.pick(("increment", "double"))
            raw, new = (new - 1, new) if op == "increment" else (new, 2 * new)
        else:
            op = d.pick(("title", "upper"))
            raw, new = new.lower(), apply_transform(op, new.lower())
        steps = find + [_transform(op, raw), _update(coll, rid, field, new)]
        return (f"The new {field} of {who} is the '{op}' op applied to '{raw}'. Apply the op "
                "with the transform tool and store the result in the record. Reply with the "
                "stored value only.", steps, str(new),
                _diff(coll, rid, field, record[field], _typed(coll, field, new)))
    # get>transform>update, search>get>transform>update: read a field, transform it, write it
    op = d.op_for(coll, field, [rid])
    new = apply_transform(op, str(record[field]))
    target = f"{entity} {rid}" if structure == "get>transform>update" else who
    steps = ([] if structure.startswith("get") else find) + [
        _get(coll, rid, field), _transform(op, record[field]), _update(coll, rid, field, new)]
    return (f"Apply the '{op}' op to the {field} of {target} and write the result back to that "
            "field. Reply with the new value only.", steps, new,
            _diff(coll, rid, field, record[field], _typed(coll, field, new)))


def _typed(coll: str, field: str, value: Any) -> Any:
    return coerce(coll, field, str(value))


def _diff(coll: str, rid: str, field: str, old: Any, new: Any) -> dict[str, Any]:
    return {coll: {rid: {field: {"old": old, "new": new}}}}


def records_task(seed: int, i: int) -> TaskSpec:
    """Task ``i`` of seed ``seed`` for Records-v0."""
    block = np.random.default_rng([seed, 0, i // len(STRUCTURES)]).permutation(len(STRUCTURES))
    structure = STRUCTURES[int(block[i % len(STRUCTURES)])]
    rng = np.random.default_rng([seed, 1, i])
    store = make_store(rng, size=8)
    d = _Draw(rng, store)
    coll = d.pick(COLLECTIONS)
    prompt, steps, answer, diff = _chain(structure, d, coll)
    skills = structure.split(">")
    writes = sorted({s["arguments"]["id"] for s in steps if s["tool"] == "update"})
    return TaskSpec(
        task_id=f"records-{seed}-{i}", prompt=prompt,
        meta=TaskMeta(skills=skills, structure=structure, entity_group=coll,
                      length=len(steps), difficulty=len(skills)),
        target={"answer": answer, "diff": diff,
                "solution": [{"item": 0, "steps": steps, "delegate": None, "returns": None}]},
        data=store, write_scopes=writes)


def records_task_pool(n: int, seed: int = 0) -> list[TaskSpec]:
    return [records_task(seed, i) for i in range(n)]


# ---------------------------------------------------------------------------------------------
# LongRecords tasks: a chain repeated over K entities, results joined in order
# ---------------------------------------------------------------------------------------------

LONG_STRUCTURES = ("map(search>get)", "map(get>transform)", "map(search>get>transform>update)")
ITEMS = {"map(search>get)": (5, 9), "map(get>transform)": (5, 9),
         "map(search>get>transform>update)": (4, 7)}  # K range [lo, hi)


def _long(structure: str, d: _Draw, coll: str, k: int) -> tuple[str, list[dict], str, dict]:
    """(prompt, solution blocks, answer, expected diff); item 0 is delegable to a sub-agent."""
    entity, rids = _entity(coll), d.records(coll, k)
    recs = [d.store[coll][r] for r in rids]
    blocks: list[dict[str, Any]] = []
    results: list[str] = []
    diff: dict[str, Any] = {}

    if structure == "map(search>get)":
        key, field = d.search_key(coll), d.readable(coll)
        listing = "\n".join(f"{n + 1}. {rec[key]}" for n, rec in enumerate(recs))
        prompt = (f"For each {entity} below, given by {key}, find its {field}: search {coll} by "
                  f"{key}, then get the record. Reply with the {field} values in the same order, "
                  f"separated by commas, and nothing else.\n{listing}")
        for n, (rid, rec) in enumerate(zip(rids, recs, strict=True)):
            value = str(rec[field])
            results.append(value)
            sub_task = (f"Find the {entity} whose {key} is '{rec[key]}' (search {coll} by "
                        f"{key}), then get its record and read its {field}. Reply with the "
                        f"{field} only.")
            blocks.append({"item": n,
                           "steps": [_search(coll, key, rec[key]), _get(coll, rid, field)],
                           "delegate": sub_task if n == 0 else None,
                           "returns": value if n == 0 else None})
    elif structure == "map(get>transform)":
        field = d.readable(coll, kinds=("text", "email", "int"))
        op = d.op_for(coll, field, rids)
        prompt = (f"For each {entity} id below, get the record, read its {field} and apply the "
                  f"'{op}' op to it with the transform tool. Reply with the results in the same "
                  f"order, separated by commas, and nothing else.\n" + ", ".join(rids))
        for n, (rid, rec) in enumerate(zip(rids, recs, strict=True)):
            value = apply_transform(op, str(rec[field]))
            results.append(value)
            sub_task = (f"Get {entity} {rid} from {coll}, read its {field} and apply the "
                        f"'{op}' op to it with the transform tool. Reply with the result only.")
            blocks.append({"item": n,
                           "steps": [_get(coll, rid, field), _transform(op, rec[field])],
                           "delegate": sub_task if n == 0 else None,
                           "returns": value if n == 0 else None})
    else:  # map(search>get>transform>update)
        key = d.search_key(coll)
        field = d.pick(f for f in WRITE_FIELDS[coll] if _kind(coll, f) == "int")
        op = d.pick(OPS_FOR_KIND["int"])
        listing = "\n".join(f"{n + 1}. {rec[key]}" for n, rec in enumerate(recs))
        prompt = (f"For each {entity} below, given by {key}: find it (search {coll} by {key}), "
                  f"get the record, apply the '{op}' op to its {field} with the transform tool "
                  f"and write the result back to {field}. Reply with the new {field} values in "
                  f"the same order, separated by commas, and nothing else.\n{listing}")
        for n, (rid, rec) in enumerate(zip(rids, recs, strict=True)):
            new = apply_transform(op, str(rec[field]))
            results.append(new)
            diff.setdefault(coll, {})[rid] = {field: {"old": rec[field], "new": int(new)}}
            read = [_search(coll, key, rec[key]), _get(coll, rid, field)]
            write = [_transform(op, rec[field]), _update(coll, rid, field, new)]
            if n == 0:  # a sub-agent reads; this agent transforms and writes
                blocks.append({"item": n, "steps": read, "returns": f"{rid}: {rec[field]}",
                               "delegate": (f"Find the {entity} whose {key} is '{rec[key]}' "
                                            f"(search {coll} by {key}) and get its record. Reply "
                                            f"with its id and {field} as 'ID: VALUE' only.")})
                blocks.append({"item": n, "steps": write, "delegate": None, "returns": None})
            else:
                blocks.append({"item": n, "steps": read + write, "delegate": None, "returns": None})
    return prompt, blocks, ", ".join(results), diff


def long_records_task(seed: int, i: int) -> TaskSpec:
    """Task ``i`` of seed ``seed`` for LongRecords-v0."""
    block = np.random.default_rng([seed, 2, i // len(LONG_STRUCTURES)]).permutation(
        len(LONG_STRUCTURES))
    structure = LONG_STRUCTURES[int(block[i % len(LONG_STRUCTURES)])]
    rng = np.random.default_rng([seed, 3, i])
    store = make_store(rng, size=10)
    d = _Draw(rng, store)
    coll = d.pick(COLLECTIONS)
    k = int(rng.integers(*ITEMS[structure]))
    prompt, blocks, answer, diff = _long(structure, d, coll, k)
    chain = structure[len("map("):-1].split(">")
    steps = [s for b in blocks for s in b["steps"]]
    writes = sorted({s["arguments"]["id"] for s in steps if s["tool"] == "update"})
    return TaskSpec(
        task_id=f"longrecords-{seed}-{i}", prompt=prompt,
        meta=TaskMeta(skills=chain, structure=structure, entity_group=coll, length=len(steps),
                      difficulty=len(chain) + 2 * (k >= 6), items=k),
        target={"answer": answer, "diff": diff, "solution": blocks},
        data=store, write_scopes=writes)


def long_records_task_pool(n: int, seed: int = 0) -> list[TaskSpec]:
    return [long_records_task(seed, i) for i in range(n)]
