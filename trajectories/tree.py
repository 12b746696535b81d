"""SessionTree: the sessions of one episode as a rooted tree (a networkx DiGraph, parent -> child).

Iteration yields sessions in creation order (the order they were given). ``validate()`` checks
what every consumer relies on: ids unique, exactly one root, every parent present, no cycle.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator

import networkx as nx

from trajectories.models import Session


class SessionTree:
    def __init__(self, sessions: Iterable[Session]):
        self._sessions: list[Session] = list(sessions)
        self._by_id: dict[str, Session] = {}
        self.graph = nx.DiGraph()
        for s in self._sessions:
            self._by_id.setdefault(s.session_id, s)
            self.graph.add_node(s.session_id)
        for s in self._sessions:
            if s.parent_id is not None and s.parent_id in self._by_id:
                self.graph.add_edge(s.parent_id, s.session_id)

    # --- container protocol -------------------------------------------------------------
    def __iter__(self) -> Iterator[Session]:
        return iter(self._sessions)

    def __len__(self) -> int:
        return len(self._sessions)

    def __getitem__(self, session_id: str) -> Session:
        try:
            return self._by_id[session_id]
        except KeyError:
            raise KeyError(f"no session {session_id!r} in this tree") from None

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._by_id

    # --- structure ----------------------------------------------------------------------
    def validate(self) -> SessionTree:
        """Raise ValueError naming the fault if this is not a single rooted tree."""
        if not self._sessions:
            raise ValueError("session tree is empty: an episode needs at least a root session")
        counts = Counter(s.session_id for s in self._sessions)
        duplicates = sorted(sid for sid, n in counts.items() if n > 1)
        if duplicates:
            raise ValueError(f"duplicate session ids: {duplicates}")
        missing = sorted(
            f"{s.session_id} (parent {s.parent_id})"
            for s in self._sessions
            if s.parent_id is not None and s.parent_id not in self._by_id
        )
        if missing:
            raise ValueError(f"sessions whose parent is missing: {missing}")
        self_loops = sorted(s.session_id for s in self._sessions if s.parent_id == s.session_id)
        if self_loops:
            raise ValueError(f"sessions that are their own parent (cycle): {self_loops}")
        roots = [s.session_id for s in self._sessions if s.parent_id is None]
        if not nx.is_directed_acyclic_graph(self.graph):
            cycle = [edge[0] for edge in nx.find_cycle(self.graph)]
            raise ValueError(f"session tree has a cycle through {cycle}")
        if len(roots) != 1:
            detail = f"{len(roots)} roots: {roots}" if roots else "no root"
            raise ValueError(f"session tree must have exactly one root, found {detail}")
        return self

    @property
    def root(self) -> Session:
        roots = [s for s in self._sessions if s.parent_id is None]
        if len(roots) != 1:
            raise ValueError(f"session tree must have exactly one root, found {len(roots)}")
        return roots[0]

    def children(self, session_id: str) -> list[Session]:
        """Children in creation order."""
        kids = set(self.graph.successors(self[session_id].session_id))
        return [s for s in self._sessions if s.session_id in kids]

    def parent(self, session_id: str) -> Session | None:
        parent_id = self[session_id].parent_id
        return None if parent_id is None else self[parent_id]

    def path_to_root(self, session_id: str) -> list[Session]:
        """[session, parent, ..., root]."""
        path = [self[session_id]]
        while path[-1].parent_id is not None:
            if len(path) > len(self._sessions):
                raise ValueError(f"cycle above session {session_id!r}")
            path.append(self[path[-1].parent_id])
        return path

    def leaves(self) -> list[Session]:
        return [s for s in self._sessions if self.graph.out_degree(s.session_id) == 0]

    def depth(self, session_id: str) -> int:
        return len(self.path_to_root(session_id)) - 1

    def distance(self, a: str, b: str) -> int:
        """Number of tree edges between two sessions."""
        up_a = [s.session_id for s in self.path_to_root(a)]
        up_b = [s.session_id for s in self.path_to_root(b)]
        common = set(up_a) & set(up_b)
        return next(i for i, sid in enumerate(up_a) if sid in common) + next(
            i for i, sid in enumerate(up_b) if sid in common
        )
