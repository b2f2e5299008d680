"""The embedded engine: one-device continuous-batching speculative decoding for Llama checkpoints.

nano-vllm's shape, one role per module: ``config`` (EngineConfig), ``sequence`` (request state,
SamplingParams), ``block_manager`` (paged KV blocks), ``scheduler`` (prefill/decode batches, preemption),
``attention`` (paged attention backends), ``model`` (Llama forward), ``drafter`` (draft proposals and
confidences), ``model_runner`` (devices, KV pools, CUDA graphs), ``engine`` (LLMEngine: the step loop
through the core), ``profile`` (step-cost curve). Submodules are imported on use: importing this package
stays free of torch so the server and CLI start fast.
"""
