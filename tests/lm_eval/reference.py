"""What lm-eval should report for the tiny model, computed without the engine: HF
transformers' own Mamba2ForCausalLM (its PyTorch path) on the same weights, full forwards.

The token ids are the ones lm-eval sends, made as lm-eval makes them: a (context,
continuation) pair is encoded whole and split at the context's length, trailing spaces of
the context moved to the continuation (``TemplateLM._encode_pair``); the vllm backend
encodes with the tokenizer's special tokens (a BOS first), local-completions without
(``add_bos_token`` False, its default).
"""

from __future__ import annotations

from pathlib import Path

import torch


class Reference:
    def __init__(self, model_dir: str | Path):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.eval()

    def encode(self, text: str, add_bos: bool) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_bos).input_ids

    @torch.no_grad()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """(len(ids), vocab) log-probabilities of the token after each position."""
        logits = self.model(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    def loglikelihood(self, context: str, continuation: str, add_bos: bool) -> tuple[float, bool]:
        """lm-eval's (sum of the continuation's logprobs, whether greedy decoding makes it)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.encode(context + continuation, add_bos)
        start = len(self.encode(context, add_bos))
        lp = self.logprobs(whole)
        total, greedy = 0.0, True
        for pos in range(start, len(whole)):
            total += lp[pos - 1, whole[pos]].item()
            greedy = greedy and int(lp[pos - 1].argmax()) == whole[pos]
        return total, greedy

    def generate_until(
        self,
        context: str,
        until: list[str],
        max_gen_toks: int,
        add_bos: bool,
        skip_special_tokens: bool,
    ) -> tuple[str, list[int]]:
        """Greedy decoding of ``max_gen_toks`` tokens at most, ending at the EOS token
        (left out of the text) or at the first stop string (the text cut before it). The
        vllm backend asks for skip_special_tokens=False; local-completions sends nothing, so
        the server's default (True) holds. Also returns the prompt ids, for the caller's
        length checks."""
        prompt = self.encode(context, add_bos)
        ids, text = list(prompt), ""
        eos = self.tokenizer.eos_token_id
        for _ in range(max_gen_toks):
            token = int(self.logprobs(ids)[-1].argmax())
            if token == eos:
                break
            ids.append(token)
            text = self.tokenizer.decode(
                ids[len(prompt) :], skip_special_tokens=skip_special_tokens
            )
            cuts = [text.index(s) for s in until if s in text]
            if cuts:
                return text[: min(cuts)], prompt
        return text, prompt


def same_text(engine_text: str, reference_text: str) -> bool:
    """Equal, but for an unfinished UTF-8 character at the end of the reference: the
    engine's incremental detokenizer (as vLLM's) never emits a trailing U+FFFD."""
    if engine_text == reference_text:
        return True
    tail = reference_text[len(engine_text) :]
    return reference_text.startswith(engine_text) and set(tail) == {"\ufffd"}
