"""Training: the GRPO loop (``train``), the SFT warm start (``sft``), what both use
(``shared``), rollout -> credit -> advantages (``rollout``), the GRPO math (``grpo``), step
records (``metrics``), the difficulty curriculum (``curriculum``), the async rollout
pipeline (``pipeline``) and ``agent_rl.train`` (``api``). Imports ``agent_rl.policies`` and
``agent_rl.run``; neither imports it."""
