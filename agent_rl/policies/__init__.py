"""Policies: the HF, vLLM and OpenAI-compatible implementations of the ``envs.runner.Policy``
protocol (``hf``, ``vllm_policy``, ``openai_policy``), what a vLLM engine is loaded with
(``engine_weights``), decoding (``decode``), model loading (``models``), chat-template
rendering and loss masks (``render``), token log-probs (``logprobs``), ``load_policy``
(``load``) and ``export`` (a bundle as a Hugging Face folder).
Imports ``agent_rl.run`` only.

Nothing is imported here, so that ``load`` (which the CLI imports for every command) stays
free of torch."""
