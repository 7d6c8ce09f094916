"""LoRA adapters, as vLLM names their request (``vllm.lora.request.LoRARequest``). This
package serves no adapters: ``LLM(enable_lora=True)`` and ``LLM.generate(...,
lora_request=...)`` refuse them with a message that says so."""
