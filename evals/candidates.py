"""Per-member summaries of candidate sets (``agent_rl/Candidates-v0``): members of one set are
correlated, so their intervals resample whole sets."""

from __future__ import annotations

from collections.abc import Sequence

from evals.stats import summarize


def candidate_intervals(records: Sequence, n_boot: int = 10000, seed: int = 0,
                        conf: float = 0.95) -> dict[str, float | int]:
    """Per-member validity over candidate sets, with a bootstrap clustered by episode.

    ``records``: episodes (``trajectories.Episode``) or their rewards' audits (dicts with
    ``k`` and ``members``). Every one of a set's k slots is a member (a missing one is
    invalid); the interval resamples whole sets (``evals.stats.summarize``), never members
    alone: ``{mean, lo, hi, n (members), n_clusters (sets)}``."""
    values: list[float] = []
    clusters: list[int] = []
    for i, record in enumerate(records):
        audit = record.reward.audit if hasattr(record, "reward") else record
        if "k" not in audit or "members" not in audit:
            raise ValueError(f"records[{i}] is not a candidate set: its audit has no 'k' and "
                             "'members' (an episode of agent_rl/Candidates-v0 has both)")
        given = [float(m["valid"]) for m in audit["members"]]
        values += given + [0.0] * (int(audit["k"]) - len(given))
        clusters += [i] * int(audit["k"])
    if not values:
        raise ValueError("no candidate sets to summarise: records is empty")
    return summarize(values, clusters, n_boot, seed, conf=conf)
