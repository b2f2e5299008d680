"""The embedded engine: one-device continuous-batching speculative decoding for Llama checkpoints.

nano-vllm's shape, one role per module: ``config`` (EngineConfig), ``sequence`` (request state,
SamplingParams), ``block_manager`` (paged KV blocks), ``scheduler`` (prefill/decode batches, preemption),
``attention`` (paged attention backends), ``model`` (Llama forward), ``drafter`` (draft proposals and
confidences), ``model_runner`` (devices, KV pools, CUDA graphs), ``engine`` (LLMEngine: the step loop
through the core), ``profile`` (step-cost curve); ``assets``/``shapes`` (model names -> checkpoints),
``synthetic`` (the speed-study drafter), ``stalls`` (compiles and full GCs), ``seeded`` (per-request random
streams), ``triton_attention``/``flashinfer_attention`` (attention kernels). Serving: ``server`` (HTTP),
``protocol`` (request validation), ``detokenizer`` (text deltas, stop strings), ``async_engine`` and
``engine_process`` (the engine's thread or process front), ``metrics`` (vLLM's metric names). Submodules are
imported on use: importing this package stays free of torch so the server and CLI start fast.
"""
