"""PIIMask-v0: replace every piece of personal data in a short text with a placeholder tag.

Description
    A short synthetic text (a support ticket, a delivery note, meeting notes, an HR record or
    a chat message) holds 1-4 PII spans: person names, email addresses, phone numbers and
    street addresses, drawn from seeded lists. Around them sit distractors that are not PII
    (order and ticket numbers, dates, amounts, times, and in harder tasks a tracking number
    that looks like a phone number). The agent returns the text with each PII span replaced
    by ``[NAME]``, ``[EMAIL]``, ``[PHONE]`` or ``[ADDRESS]`` and everything else unchanged,
    inside ``<masked>...</masked>``. The task of the Korean RLVR talk on PII masking
    (seeds/004), generated instead of drawn from a data set, so it is offline and unbounded.

Tools
    None.

Observation
    ``[system, user]``: instructions and the text to mask.

Reward
    Three components in [0, 1], weights ``accuracy`` 0.6, ``format`` 0.2, ``pii_count`` 0.2
    (``pii_mask_reward``, reused by evaluation). The answer is the content of the last
    ``<masked>`` tag; comparisons are after whitespace normalisation (runs of whitespace ->
    one space, stripped).

    * ``accuracy``: 1 when the answer equals the gold masked text. Otherwise partial credit
      ``0.5 * (masked spans / gold spans)``, where a gold span is masked when its tag stands
      in the answer between the same neighbouring text as in the gold (up to 16 characters
      each side, stopping at the next tag) and its original value appears nowhere in the
      answer.
    * ``format``: the reply holds exactly one ``<masked>...</masked>``.
    * ``pii_count``: the answer holds as many placeholder tags as the gold and none of the
      original PII values (a tag added beside a value it should replace masks nothing).

    Exact answer: 1.0. No tag: 0.

Episode end
    The first reply ends the episode: outcome ``correct`` on an exact match, ``format_error``
    when the reply has no ``<masked>`` tag, ``wrong`` otherwise.

Version history
    v0: first release.
    v1 (same id): ``pii_count`` needs every PII value gone; in v0 the unmasked text plus the
    right number of tags scored 0.4.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from envs.core import TaskMeta, TaskSpec, ToolEnv
from trajectories import Outcome, RewardBreakdown

WEIGHTS = {"accuracy": 0.6, "format": 0.2, "pii_count": 0.2}
KINDS = ("NAME", "EMAIL", "PHONE", "ADDRESS")
_ANSWER = re.compile(r"<masked>(.*?)</masked>", re.DOTALL)
_TAG = re.compile(r"\[(?:NAME|EMAIL|PHONE|ADDRESS)\]")
_SLOT = re.compile(r"\{([A-Z]+)\}")
_CONTEXT = 16  # characters of neighbouring text a masked span must keep, each side

# --- the reward: small pure functions -----------------------------------------------------


def normalize(text: str) -> str:
    """Collapse every run of whitespace to one space and strip."""
    return " ".join(text.split())


def extract_masked(reply: str) -> tuple[str | None, int]:
    """(content of the last ``<masked>`` tag or None, how many tags the reply holds)."""
    found = _ANSWER.findall(reply)
    return (found[-1] if found else None), len(found)


def masked_spans(answer: str, gold: str, values: list[str]) -> int:
    """How many gold spans the (normalised) answer masks: tag in place and value gone."""
    tags = list(_TAG.finditer(gold))
    hits = 0
    for i, (tag, value) in enumerate(zip(tags, values, strict=True)):
        left_end = tags[i - 1].end() if i > 0 else 0
        right_end = tags[i + 1].start() if i + 1 < len(tags) else len(gold)
        left = gold[max(left_end, tag.start() - _CONTEXT):tag.start()]
        right = gold[tag.end():min(right_end, tag.end() + _CONTEXT)]
        hits += (left + tag.group() + right) in answer and normalize(value) not in answer
    return hits


def pii_mask_reward(reply: str, gold: str, values: list[str]) -> dict[str, float]:
    """The three reward components of a reply against the gold masked text and PII values."""
    answer, n_tags = extract_masked(reply)
    if answer is None:
        return {"accuracy": 0.0, "format": 0.0, "pii_count": 0.0}
    answer, gold = normalize(answer), normalize(gold)
    if answer == gold:
        accuracy = 1.0
    else:
        accuracy = 0.5 * masked_spans(answer, gold, values) / max(len(values), 1)
    unmasked = any(normalize(value) in answer for value in values)
    count = float(len(_TAG.findall(answer)) == len(_TAG.findall(gold)) and not unmasked)
    return {"accuracy": accuracy, "format": float(n_tags == 1), "pii_count": count}


def pii_mask_outcome(reply: str, components: dict[str, float]) -> Outcome:
    if components["accuracy"] == 1.0:
        return Outcome.correct
    return Outcome.format_error if extract_masked(reply)[0] is None else Outcome.wrong


# --- seeded data --------------------------------------------------------------------------

FIRST = ("Ava", "Liam", "Maya", "Noah", "Priya", "Omar", "Sofia", "Mateo", "Chen", "Hana",
         "Lucas", "Amara", "Elena", "Kofi", "Ines", "Jonas", "Leila", "Ravi", "Yuki", "Tomas",
         "Nadia", "Diego", "Freya", "Malik", "Zara", "Henrik", "Aiko", "Samir", "Clara", "Felix")
LAST = ("Okafor", "Lindqvist", "Moreau", "Tanaka", "Brennan", "Haddad", "Kowalski", "Alvarez",
        "Nguyen", "Fischer", "Rossi", "Mensah", "Petrov", "Sato", "Dubois", "Kaur", "Novak",
        "Schmidt", "Costa", "Ibrahim", "Walsh", "Yamada", "Larsen", "Morales", "Quinn", "Osei",
        "Varga", "Hughes", "Eriksen", "Castillo")
DOMAINS = ("example.com", "example.org", "mail.test", "inbox.test", "postbox.example",
           "corpmail.test")
STREETS = ("Maple Street", "Oak Avenue", "Cedar Lane", "Birch Road", "Willow Way",
           "Harbor Drive", "Elm Court", "Pine Street", "Lakeview Terrace", "Mill Road",
           "Orchard Lane", "Station Road", "Hillcrest Avenue", "Riverside Drive",
           "Chestnut Street", "Park Place", "Sunset Boulevard", "Meadow Lane", "Church Street",
           "King Street", "Bridge Road", "Forest Avenue", "Garden Row", "Spruce Street",
           "Ash Grove", "Victoria Road", "Quarry Lane", "Beacon Street", "Linden Avenue",
           "Canal Street")
CITIES = ("Springfield", "Riverton", "Lakeside", "Fairview", "Brookfield", "Ashford", "Milton",
          "Greenville", "Kingsport", "Westbury", "Northam", "Clearwater")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December")

# Template families: an opening with a distractor, 2 fragments per PII kind (one PII slot
# each), and a closing that carries a phone-like tracking number (harder tasks only).
FAMILIES: dict[str, dict[str, tuple[str, ...]]] = {
    "support_ticket": {
        "intro": ("Ticket {TICKET} opened on {DATE}.", "Support request {TICKET}, order {ORDER}."),
        "NAME": ("The customer is {NAME}.", "Escalated by {NAME} from billing."),
        "EMAIL": ("Reply to {EMAIL} once resolved.", "Contact email on file: {EMAIL}."),
        "PHONE": ("Callback number: {PHONE}.", "They asked to be called at {PHONE} after {TIME}."),
        "ADDRESS": ("Ship the replacement to {ADDRESS}.", "Billing address: {ADDRESS}."),
        "outro": ("Courier reference {TRACKING}.",),
    },
    "delivery_note": {
        "intro": ("Delivery for order {ORDER}, total {AMOUNT}.", "Parcel scheduled for {DATE}."),
        "NAME": ("Recipient: {NAME}.", "Signed for by {NAME}."),
        "EMAIL": ("Send the receipt to {EMAIL}.", "Notifications go to {EMAIL}."),
        "PHONE": ("Driver should call {PHONE} on arrival.", "Recipient phone: {PHONE}."),
        "ADDRESS": ("Deliver to {ADDRESS}.", "Return address is {ADDRESS}."),
        "outro": ("Tracking number {TRACKING}.",),
    },
    "meeting_notes": {
        "intro": ("Notes from the {TIME} sync on {DATE}.", "Budget review, {AMOUNT} approved."),
        "NAME": ("{NAME} will draft the proposal.", "Minutes taken by {NAME}."),
        "EMAIL": ("Questions to {EMAIL} by Friday.", "The invite came from {EMAIL}."),
        "PHONE": ("Dial-in for the vendor: {PHONE}.", "The supplier can be reached on {PHONE}."),
        "ADDRESS": ("The offsite moves to {ADDRESS}.", "Samples were sent to {ADDRESS}."),
        "outro": ("Purchase order {TRACKING} is pending.",),
    },
    "hr_record": {
        "intro": ("Employee file updated on {DATE}.", "Record {TICKET}, salary band {AMOUNT}."),
        "NAME": ("Employee name: {NAME}.", "Emergency contact is {NAME}."),
        "EMAIL": ("Personal email: {EMAIL}.", "Payslips are mailed to {EMAIL}."),
        "PHONE": ("Mobile: {PHONE}.", "Emergency phone: {PHONE}."),
        "ADDRESS": ("Home address: {ADDRESS}.", "Previous address was {ADDRESS}."),
        "outro": ("Badge serial {TRACKING}.",),
    },
    "chat_message": {
        "intro": ("hey, about order {ORDER}:", "quick update before {TIME}:"),
        "NAME": ("{NAME} says hi.", "ask {NAME} about it."),
        "EMAIL": ("my new email is {EMAIL}", "cc {EMAIL} please"),
        "PHONE": ("text me at {PHONE}", "my number changed to {PHONE}"),
        "ADDRESS": ("we moved to {ADDRESS}", "party is at {ADDRESS} on {DATE}"),
        "outro": ("(ref {TRACKING})",),
    },
}


@dataclass(frozen=True)
class MaskedText:
    text: str  # the original, shown to the agent
    gold: str  # the masked text
    kinds: list[str]  # PII kinds in order of appearance
    values: list[str]  # the original PII values, same order


def _pii_value(kind: str, rng: np.random.Generator, used: set[str]) -> str:
    while True:
        first, last = str(rng.choice(FIRST)), str(rng.choice(LAST))
        if kind == "NAME":
            value = f"{first} {last}"
        elif kind == "EMAIL":
            user = str(rng.choice([f"{first}.{last}", f"{first[0]}{last}",
                                   f"{first}{int(rng.integers(10, 99))}"])).lower()
            value = f"{user}@{rng.choice(DOMAINS)}"
        elif kind == "PHONE":
            d = [int(x) for x in rng.integers(0, 10, size=4)]
            style = int(rng.integers(3))
            value = (f"(555) 01{d[0]}-{d[1]}{d[2]}{d[3]}{d[0]}", f"555-01{d[1]}{d[2]}",
                     f"+1 555 01{d[0]} {d[1]}{d[2]}{d[3]}{d[1]}")[style]
        else:
            apt = f"Apt {int(rng.integers(1, 30))}, " if rng.random() < 0.3 else ""
            value = f"{int(rng.integers(1, 400))} {rng.choice(STREETS)}, {apt}{rng.choice(CITIES)}"
        if value not in used:
            used.add(value)
            return value


def _distractor(slot: str, rng: np.random.Generator) -> str:
    if slot == "TICKET":
        return f"T-{int(rng.integers(1000, 10000))}"
    if slot == "ORDER":
        return f"#{int(rng.integers(10000, 100000))}"
    if slot == "DATE":
        return f"{rng.choice(MONTHS)} {int(rng.integers(1, 29))}"
    if slot == "AMOUNT":
        return f"${int(rng.integers(5, 5000))}.{int(rng.integers(0, 100)):02d}"
    if slot == "TIME":
        return f"{int(rng.integers(8, 18))}:{int(rng.choice([0, 15, 30, 45])):02d}"
    if slot == "TRACKING":  # looks like a phone number, is not one
        return "-".join(str(int(rng.integers(1000, 10000))) for _ in range(3))
    raise KeyError(f"template slot {{{slot}}} has no generator")


def make_text(rng: np.random.Generator, family: str, kinds: list[str], lookalike: bool) -> MaskedText:
    """Render one text of a family with PII fragments in the order of `kinds`."""
    spec = FAMILIES[family]
    fragments = {k: list(rng.permutation(spec[k])) for k in KINDS}
    pieces = [str(rng.choice(spec["intro"]))] + [str(fragments[k].pop()) for k in kinds]
    if lookalike:
        pieces.append(str(rng.choice(spec["outro"])))
    text, gold, values, used = [], [], [], set()

    def fill(match: re.Match) -> str:
        slot = match.group(1)
        if slot in KINDS:
            values.append(_pii_value(slot, rng, used))
            gold.append(f"[{slot}]")
            return values[-1]
        value = _distractor(slot, rng)
        gold.append(value)
        return value

    for piece in pieces:
        pos = 0
        for m in _SLOT.finditer(piece):
            gold.append(piece[pos:m.start()])
            text.append(piece[pos:m.start()] + fill(m))
            pos = m.end()
        gold.append(piece[pos:] + " ")
        text.append(piece[pos:] + " ")
    return MaskedText("".join(text).strip(), "".join(gold).strip(), list(kinds), values)


# --- the environment ----------------------------------------------------------------------


class PIIMaskEnv(ToolEnv):
    env_id = "agent_rl/PIIMask-v0"
    version = 1
    instructions = (
        "You mask personal data. Replace every person name with [NAME], every email address "
        "with [EMAIL], every phone number with [PHONE] and every street address with "
        "[ADDRESS]. Leave all other text exactly as it is (order numbers, dates, amounts and "
        "reference numbers are not personal data). Reply with the masked text inside "
        "<masked>...</masked>."
    )
    reward_weights = WEIGHTS

    def task_pool(self, n: int, seed: int = 0) -> list[TaskSpec]:
        rng = np.random.default_rng(seed)
        return [self._make_task(rng, f"pii-{seed}-{i}") for i in range(n)]

    def _make_task(self, rng: np.random.Generator, task_id: str) -> TaskSpec:
        family = str(rng.choice(sorted(FAMILIES)))
        n_pii = int(rng.integers(1, 5))
        kinds = [str(k) for k in rng.permutation([k for k in KINDS for _ in range(2)])[:n_pii]]
        lookalike = bool(rng.random() < 0.5)
        sample = make_text(rng, family, kinds, lookalike)
        lower = [k.lower() for k in kinds]
        return TaskSpec(
            task_id=task_id,
            prompt=f"Mask the personal data in this text:\n\n{sample.text}",
            meta=TaskMeta(skills=sorted(set(lower)), structure=">".join(lower),
                          entity_group=family, length=n_pii, difficulty=n_pii + lookalike),
            target=sample.gold,
            data={"text": sample.text, "values": sample.values, "kinds": sample.kinds},
        )

    def score(self, task: TaskSpec, answer: str, state: None) -> RewardBreakdown:
        components = pii_mask_reward(answer, task.target, task.data["values"])
        return RewardBreakdown.from_components(components, WEIGHTS,
                                               pii_mask_outcome(answer, components),
                                               f"{self.env_id}@{self.version}")

    def reference_action(self) -> str | None:
        return None if self.task is None else f"<masked>{self.task.target}</masked>"
