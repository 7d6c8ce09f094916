"""The vLLM Python API lm-eval's vllm backend imports and calls, each where vLLM has it: the
installed version, TokensPrompt, LoRARequest, get_tokenizer, the chat-template resolver,
LLM(...) with the keywords lm-eval passes (the unsupported ones refused by name),
generate on TokensPrompts, prompt logprobs shaped as vLLM's, and the generation keywords
(detokenize, skip_special_tokens, spaces_between_special_tokens)."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from tests.tiny_model import EOS, IM_START
from vllm import LLM, SamplingParams, TextPrompt, TokensPrompt
from vllm.engine.core import EngineCoreOutput
from vllm.engine.output_processor import OutputProcessor
from vllm.engine.tokenizer import get_tokenizer as engine_tokenizer
from vllm.entrypoints.chat_utils import resolve_hf_chat_template
from vllm.lora.request import LoRARequest
from vllm.outputs import Logprob
from vllm.transformers_utils.tokenizer import get_tokenizer

pytestmark = pytest.mark.timeout(600)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# What lm-eval 0.4.13's VLLM.__init__ hands to LLM(**model_args) by default, plus the seed's
# gpu_memory_utilization and vLLM's swap_space / enable_prefix_caching.
LM_EVAL_ARGS = dict(
    revision=None,
    dtype="auto",
    tokenizer=None,
    tokenizer_mode="auto",
    tokenizer_revision=None,
    trust_remote_code=False,
    tensor_parallel_size=1,
    max_model_len=128,
    max_num_seqs=None,
    quantization=None,
    seed=1234,
    enable_lora=False,
    max_lora_rank=16,
    gpu_memory_utilization=0.9,
    swap_space=4,
    enable_prefix_caching=False,
)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), device=DEVICE, **LM_EVAL_ARGS)


def test_the_installed_version_is_one_lm_eval_takes_the_vllm_api_path_for():
    from packaging.version import Version

    import vllm

    installed = importlib.metadata.version("vllm")
    assert installed == vllm.__version__  # setup.py reads it from vllm/__init__.py
    # lm-eval resolves the chat template (>= 0.8.3) with model_config (>= 0.9.0).
    assert Version(installed) >= Version("0.9.0")


def test_prompt_types_and_lora_request_are_vllms():
    assert TokensPrompt(prompt_token_ids=[1, 2]) == {"prompt_token_ids": [1, 2]}
    assert TextPrompt(prompt="hi") == {"prompt": "hi"}
    lora = LoRARequest("finetuned", 1, "/adapters/x")  # lm-eval's positional call
    assert (lora.name, lora.adapter_id, lora.path) == ("finetuned", 1, "/adapters/x")
    with pytest.raises(ValueError, match="lora_int_id must be >= 1"):
        LoRARequest("x", 0)


def test_get_tokenizer_is_the_engines_tokenizer(tiny_model_dir):
    tok = get_tokenizer(str(tiny_model_dir), tokenizer_mode="auto", trust_remote_code=False)
    engine = engine_tokenizer(tiny_model_dir, 512)
    text = "The state space model: 42 tokens"
    assert tok(text).input_ids == engine.encode(text)
    assert tok.name_or_path and tok.truncation_side == "left"
    with pytest.raises(ValueError, match="tokenizer_mode"):
        get_tokenizer(str(tiny_model_dir), tokenizer_mode="mistral")


def test_chat_template_resolution(tiny_model_dir, tmp_path):
    from tests.tiny_model import make_tiny_model_dir

    tok = get_tokenizer(str(tiny_model_dir))
    assert resolve_hf_chat_template(tok, None, None, model_config=None) == tok.chat_template
    assert resolve_hf_chat_template(tok, "{{ x }}", None, model_config=None) == "{{ x }}"
    plain = get_tokenizer(str(make_tiny_model_dir(tmp_path / "plain", chat_template=None)))
    assert resolve_hf_chat_template(plain, None, None, model_config=None) is None


def test_lm_evals_keywords_are_taken(llm):
    config = llm.llm_engine.config
    assert llm.llm_engine is llm.engine
    assert llm.llm_engine.model_config.max_model_len == 128  # what lm-eval reads
    assert config.seed == 1234 and config.max_num_seqs == 64  # None: the default
    assert config.dtype is None  # "auto": the config's dtype


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"pipeline_parallel_size": 2}, "pipeline parallelism is not supported yet"),
        ({"quantization": "awq"}, "quantized models are not supported"),
        ({"enable_lora": True}, "LoRA adapters are not supported"),
        ({"tokenizer_mode": "slow"}, "tokenizer_mode='slow' is not supported"),
        ({"revision": "main"}, "revision='main' \\(--revision\\) picks a snapshot of a Hugging"),
        ({"code_revision": "main"}, "this package runs no remote model code"),
        ({"swap_space": -1}, "swap_space"),
        ({"trust_remote_code": "yes"}, "trust_remote_code must be true or false"),
    ],
)
def test_unsupported_keywords_are_refused_by_name(tiny_model_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(model=str(tiny_model_dir), device=DEVICE, **kwargs)


def test_unknown_keywords_are_a_type_error(tiny_model_dir):
    with pytest.raises(TypeError, match="'no_such_option'"):
        LLM(model=str(tiny_model_dir), device=DEVICE, no_such_option=1)


def test_generate_token_prompts_with_prompt_logprobs_as_lm_eval_asks(llm):
    prompts = [[1, 76, 387, 225, 342], [1, 464]]
    params = SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1, detokenize=False)
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        sampling_params=params,
        use_tqdm=False,
        lora_request=None,
    )
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_token_ids == prompt
        lps = out.prompt_logprobs
        assert len(lps) == len(prompt) and lps[0] is None  # nothing predicts the first
        for token, position in zip(prompt[1:], lps[1:], strict=True):
            assert token in position and all(isinstance(v, Logprob) for v in position.values())
            assert 1 <= len(position) <= 2  # the prompt token and the top-1
            best = min(position.values(), key=lambda lp: lp.rank)
            assert best.rank == 1 and best.logprob == max(v.logprob for v in position.values())
            assert position[token].logprob <= 0.0 and position[token].decoded_token is None
        [completion] = out.outputs
        assert completion.text == "" and len(completion.token_ids) == 1  # detokenize=False


def test_prompt_logprobs_keep_their_text_when_detokenizing(llm):
    params = SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1)
    [out] = llm.generate([[1, 76, 387]], params, use_tqdm=False)
    assert out.prompt_logprobs[1][76].decoded_token == llm.get_tokenizer().decode([76])


def test_a_lora_request_or_an_unknown_prompt_key_is_refused(llm):
    with pytest.raises(ValueError, match="LoRA adapters are not supported"):
        llm.generate([[1, 2]], SamplingParams(), lora_request=LoRARequest("x", 1, "/p"))
    with pytest.raises(ValueError, match="'multi_modal_data' is not supported"):
        llm.generate([{"prompt_token_ids": [1, 2], "multi_modal_data": {}}], SamplingParams())
    assert not llm.engine.has_unfinished_requests()


def test_generation_keywords_are_checked():
    with pytest.raises(ValueError, match="detokenize=False"):
        SamplingParams(stop=["\n"], detokenize=False)
    for name in ("detokenize", "skip_special_tokens", "spaces_between_special_tokens"):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: "no"})
    child = SamplingParams(n=2, skip_special_tokens=False, detokenize=False).child(1)
    assert child.skip_special_tokens is False and child.detokenize is False


def _texts(tiny_model_dir, params: SamplingParams, tokens: list[int], finish: str | None):
    """The text the output processor makes of these generated tokens (one core step)."""
    tok = engine_tokenizer(tiny_model_dir, 512)
    proc = OutputProcessor(tok)
    proc.add_request("r", None, [1, 76], params)
    core = EngineCoreOutput("r", tokens, finish_reason=finish)
    [out], _, _ = proc.process_outputs([core])
    return out.outputs[0].text, tok


def test_special_tokens_are_kept_on_request_and_a_final_eos_never(tiny_model_dir):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(tiny_model_dir)).convert_tokens_to_ids
    im_start, eos = ids(IM_START), ids(EOS)
    tokens = [387, im_start, 225, eos]
    keep = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    kept, tok = _texts(tiny_model_dir, keep, tokens, "stop")
    skipped, _ = _texts(tiny_model_dir, SamplingParams(), tokens, "stop")
    assert kept == tok.decode(tokens[:-1], skip_special_tokens=False)
    assert IM_START in kept and EOS not in kept  # the EOS that ended it: no text (vLLM's)
    assert skipped == tok.decode(tokens[:-1]) and IM_START not in skipped
    # Not an ending: an EOS in the middle (ignore_eos) is text like any special token.
    middle, _ = _texts(tiny_model_dir, keep, tokens, None)
    assert middle.endswith(EOS)
