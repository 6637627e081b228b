"""The engine: sequence, block_manager, scheduler, model_runner, llm_engine (nano-vllm's split)."""
