"""Our model configs as HF transformers configs and models, for any registered architecture.

``hf_config(config)`` gives the transformers config class of ``config.architecture``
(``MambaConfig``, ``FalconMambaConfig``, ``Lfm2Config``, ``GraniteMoeHybridConfig``,
``NemotronHConfig``, ...) with our config's fields. Our field names are transformers' own
(each config module says so), so most fields pass as they are; the few that differ are
renamed here (``_RENAMES``), RoPE's theta goes in as transformers 5's ``rope_parameters``,
and fields derived in our ``__post_init__`` (``init=False``) are left to transformers to
derive again, as are fields left None (unset: transformers fills them in). The result is
then read back through our own loader (``config_class.from_dict(hf.to_dict())``) and must
give our config again: a field this mapping gets wrong fails there, naming the fields
that differ, rather than benchmarking another shape.

``hf_model_class(config)`` is transformers' class of the same name as our architecture.
"""

from __future__ import annotations

from dataclasses import asdict, fields

# architecture -> {our field: transformers' key}
_RENAMES = {
    "NemotronHForCausalLM": {"layer_types": "layers_block_type"},
}
# Fields not compared on the way back: LFM2's full_attn_idxs, which transformers does not
# keep once layer_types (which our config always fills in from it) names the layers.
_NOT_READ_BACK = {"Lfm2ForCausalLM": ("full_attn_idxs",)}
# Fields transformers 5 reads from rope_parameters instead.
_ROPE_FIELDS = ("rope_theta",)


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def hf_config_kwargs(config) -> dict:
    """The keyword arguments of transformers' config class for our ``config``."""
    renames = _RENAMES.get(config.architecture, {})
    values = {}
    for f in fields(config):
        # None: transformers' default (Granite's head_dim None would be taken as given)
        if not f.init or f.name == "dtype" or getattr(config, f.name) is None:
            continue
        values[renames.get(f.name, f.name)] = _plain(getattr(config, f.name))
    theta = {k: values.pop(k) for k in _ROPE_FIELDS if k in values}
    if theta:
        values["rope_parameters"] = {"rope_type": "default", **theta}
    if config.architecture == "Mamba2ForCausalLM":
        values["time_step_limit"] = tuple(values["time_step_limit"])
    if config.architecture == "Lfm2ForCausalLM" and values.get("layer_types") is not None:
        values.pop("full_attn_idxs", None)  # layer_types wins in both readers
    values["architectures"] = [config.architecture]
    return values


def hf_model_class(config) -> type:
    """transformers' model class for ``config.architecture``."""
    import transformers

    cls = getattr(transformers, config.architecture, None)
    if cls is None:
        raise ValueError(
            f"transformers {transformers.__version__} has no {config.architecture}: "
            "--backend hf cannot build this model"
        )
    return cls


def hf_config(config):
    """transformers' config of our ``config``'s architecture, with its shape (checked by
    reading it back: ValueError naming the fields that came back different)."""
    hf = hf_model_class(config).config_class(**hf_config_kwargs(config))
    check_round_trip(config, hf)
    return hf


def config_differences(config, back) -> dict:
    """{field: (ours, read back)} for the fields where ``back`` (our config read from
    transformers' keys) is not ``config``; dtype and the fields transformers drops apart."""
    ours, theirs = asdict(config), asdict(back)
    for name in ("dtype", *_NOT_READ_BACK.get(config.architecture, ())):
        ours.pop(name, None)
        theirs.pop(name, None)
    return {k: (v, theirs.get(k)) for k, v in ours.items() if theirs.get(k) != v}


def check_round_trip(config, hf) -> None:
    wrong = config_differences(config, type(config).from_dict(hf.to_dict()))
    if wrong:
        raise ValueError(
            f"transformers' {type(hf).__name__} does not carry {config.architecture}'s shape: "
            + "; ".join(f"{k}: ours {a!r}, read back {b!r}" for k, (a, b) in wrong.items())
        )
