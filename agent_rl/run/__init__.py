"""Run infrastructure, the ground floor of ``agent_rl``: the experiment contract
(``contract``), checkpoint bundles (``checkpoint``), distributed backends (``distributed``),
the run directory and its lock (``rundir``, ``runlock``), guards (``guards``) and devices
(``devices``). It imports no other ``agent_rl`` subpackage."""
