"""The lean engine: config, sequence, scheduler, state manager, sampler, tokenizer, LLMEngine."""
