"""The bad-input cases of the causal-conv1d ops: each starts from a valid call and breaks
one thing, with the pattern the ValueError must name, and whether only data validation
finds it; shared by test_causal_conv1d_errors.py (the ops) and test_causal_conv1d_host*.py
(the host-side checks), which also take the valid calls and the check from here."""

from __future__ import annotations

from vllm.model_executor.layers.mamba.ops.causal_conv1d import PAD_SLOT_ID

from .conv_error_base import (
    DIM,
    FP32,
    LINES,
    WIDTH,
    _expanded_pool,
    _expect_value_error,
    _i32,
    _other_meta,
    _pool,
    _set,
    _strided,
    _then,
    _token_major,
    _upd_x3d,
    _varlen,
    fn_kwargs,
    update_kwargs,
)
from .conv_utils import gen_for, make_weight, qsl_from_lens

# The valid calls and the check, for the tests that import this module as a whole.
__all__ = ["DIM", "FN_ERRORS", "UPDATE_ERRORS", "_expect_value_error", "fn_kwargs", "update_kwargs"]

# The padded-row marker: pad_slot_id and null_block_id name it, once or alike.
MARKER_ERRORS = [
    (
        "null_block_id_differs_from_pad_slot_id",
        _set(pad_slot_id=lambda kw, d: PAD_SLOT_ID, null_block_id=lambda kw, d: 0),
        r"null_block_id",
        False,
    ),
    (
        "null_block_id_differs_from_given_pad",
        _set(pad_slot_id=lambda kw, d: 7, null_block_id=lambda kw, d: 0),
        r"null_block_id",
        False,
    ),
    ("null_block_id_str", _set(null_block_id=lambda kw, d: "0"), r"null_block_id", False),
    ("null_block_id_bool", _set(null_block_id=lambda kw, d: False), r"null_block_id", False),
    ("pad_slot_id_float", _set(pad_slot_id=lambda kw, d: -1.0), r"pad_slot_id", False),
]


# (id, mutation, argument name pattern, validate_data)
FN_ERRORS = [
    ("x_3d", _set(x=lambda kw, d: kw["x"][None]), r"\bx\b", False),
    ("x_1d", _set(x=lambda kw, d: kw["x"][:, 0]), r"\bx\b", False),
    ("x_token_contiguous", _set(x=lambda kw, d: _token_major(kw["x"])), r"\bx\b", False),
    ("x_fp64", _set(x=lambda kw, d: kw["x"].double()), r"\bx\b", False),
    ("x_int32", _set(x=lambda kw, d: (8 * kw["x"]).int()), r"\bx\b", False),
    ("weight_1d", _set(weight=lambda kw, d: kw["weight"][:, 0]), r"\bweight\b", False),
    ("weight_dim", _set(weight=lambda kw, d: kw["weight"][:-8]), r"\bweight\b", False),
    ("weight_W1", _set(weight=lambda kw, d: kw["weight"][:, :1]), r"\bweight\b", False),
    (
        "weight_W9",
        _set(weight=lambda kw, d: make_weight(DIM, 9, FP32, d, gen_for("w9"))),
        r"\bweight\b",
        False,
    ),
    (
        "weight_stride",
        _set(weight=lambda kw, d: kw["weight"].t().contiguous().t()),
        r"\bweight\b",
        False,
    ),
    ("bias_dim", _set(bias=lambda kw, d: kw["bias"][:-8]), r"\bbias\b", False),
    ("bias_2d", _set(bias=lambda kw, d: kw["bias"][None]), r"\bbias\b", False),
    ("conv_states_2d", _set(conv_states=lambda kw, d: kw["conv_states"][0]), r"conv_states", False),
    # any strides are served (test_causal_conv1d_compat.py), aliasing ones are not
    ("conv_states_expanded", _set(conv_states=_expanded_pool), r"conv_states", False),
    ("conv_states_dim", _set(conv_states=_pool(dim=DIM - 8)), r"conv_states", False),
    ("conv_states_short", _set(conv_states=_pool(state_len=WIDTH - 2)), r"conv_states", False),
    (
        "conv_states_int32",
        _set(conv_states=lambda kw, d: (8 * kw["conv_states"]).int()),
        r"conv_states",
        False,
    ),
    (
        "query_start_loc_int64",
        _set(query_start_loc=lambda kw, d: kw["query_start_loc"].long()),
        r"query_start_loc",
        False,
    ),
    (
        "query_start_loc_2d",
        _set(query_start_loc=lambda kw, d: kw["query_start_loc"][None]),
        r"query_start_loc",
        False,
    ),
    (
        "cache_indices_int64",
        _set(cache_indices=lambda kw, d: kw["cache_indices"].long()),
        r"cache_indices",
        False,
    ),
    (
        "cache_indices_len",
        _set(cache_indices=lambda kw, d: kw["cache_indices"][:2]),
        r"cache_indices",
        False,
    ),
    (
        "has_initial_state_len",
        _set(has_initial_state=lambda kw, d: kw["has_initial_state"][:2]),
        r"has_initial_state",
        False,
    ),
    ("activation_relu", _set(activation=lambda kw, d: "relu"), r"activation", False),
    ("bias_strided", _set(bias=lambda kw, d: _strided(kw["bias"])), r"\bbias\b", False),
    (
        "query_start_loc_strided",
        _set(query_start_loc=lambda kw, d: _strided(kw["query_start_loc"])),
        r"query_start_loc",
        False,
    ),
    (
        "cache_indices_strided",
        _set(cache_indices=lambda kw, d: _strided(kw["cache_indices"])),
        r"cache_indices",
        False,
    ),
    (
        "has_initial_state_strided",
        _set(has_initial_state=lambda kw, d: _strided(kw["has_initial_state"])),
        r"has_initial_state",
        False,
    ),
    *MARKER_ERRORS,
    ("metadata_other_num_tokens", _set(metadata=_other_meta((3, 1, 3))), r"metadata", False),
    ("metadata_other_batch", _set(metadata=_other_meta((4, 2))), r"metadata", False),
    # validate_data=True: checks that read the index tensors
    (
        "query_start_loc_not_from_0",
        _set(query_start_loc=lambda kw, d: _i32([1, 3, 4, 6], d)),
        r"query_start_loc",
        True,
    ),
    (
        "query_start_loc_decreasing",
        _set(query_start_loc=lambda kw, d: _i32([0, 4, 3, 6], d)),
        r"query_start_loc",
        True,
    ),
    (
        "query_start_loc_last_not_num_tokens",
        _set(query_start_loc=lambda kw, d: _i32([0, 3, 4, 5], d)),
        r"query_start_loc",
        True,
    ),
    (
        "cache_indices_out_of_range",
        _set(cache_indices=lambda kw, d: _i32([3, 0, LINES], d)),
        r"cache_indices",
        True,
    ),
    (
        "cache_indices_duplicate",
        _set(cache_indices=lambda kw, d: _i32([3, 1, 3], d)),
        r"cache_indices",
        True,
    ),
]


UPDATE_ERRORS = [
    ("x_1d", _set(x=lambda kw, d: kw["x"][0]), r"\bx\b", False),
    ("x_4d", _set(x=lambda kw, d: kw["x"][:, :, None, None]), r"\bx\b", False),
    ("x_feature_stride", _set(x=lambda kw, d: kw["x"].t().contiguous().t()), r"\bx\b", False),
    (
        "x_3d_token_contiguous",
        _set(x=lambda kw, d: _upd_x3d(2)(kw, d).contiguous()),
        r"\bx\b",
        False,
    ),
    ("x_fp64", _set(x=lambda kw, d: kw["x"].double()), r"\bx\b", False),
    ("x_int32", _set(x=lambda kw, d: (8 * kw["x"]).int()), r"\bx\b", False),
    ("x_dim", _set(x=lambda kw, d: kw["x"][:, :-8]), r"\bx\b|\bweight\b|conv_state", False),
    ("conv_state_expanded", _set(conv_state=_expanded_pool), r"conv_states?", False),
    ("conv_state_2d", _set(conv_state=lambda kw, d: kw["conv_state"][0]), r"conv_states?", False),
    ("conv_state_dim", _set(conv_state=_pool(dim=DIM - 8)), r"conv_states?", False),
    ("conv_state_short", _set(conv_state=_pool(state_len=WIDTH - 2)), r"conv_states?", False),
    ("weight_W1", _set(weight=lambda kw, d: kw["weight"][:, :1]), r"\bweight\b", False),
    (
        "weight_W9",
        _set(weight=lambda kw, d: make_weight(DIM, 9, FP32, d, gen_for("w9"))),
        r"\bweight\b",
        False,
    ),
    ("weight_dim", _set(weight=lambda kw, d: kw["weight"][:-8]), r"\bweight\b", False),
    ("bias_dim", _set(bias=lambda kw, d: kw["bias"][:-8]), r"\bbias\b", False),
    (
        "conv_state_indices_int64",
        _set(conv_state_indices=lambda kw, d: kw["conv_state_indices"].long()),
        r"conv_state_indices",
        False,
    ),
    (
        "conv_state_indices_len",
        _set(conv_state_indices=lambda kw, d: kw["conv_state_indices"][:2]),
        r"conv_state_indices",
        False,
    ),
    (
        "num_accepted_tokens_int64",
        _set(num_accepted_tokens=lambda kw, d: _i32([1, 2, 1], d).long()),
        r"num_accepted_tokens",
        False,
    ),
    (
        "num_accepted_tokens_len",
        _set(num_accepted_tokens=lambda kw, d: _i32([1, 2], d)),
        r"num_accepted_tokens",
        False,
    ),
    (
        # speculative decoding needs W-1 + seqlen-1 columns: 3 + 3 > 5
        "spec_conv_state_too_short",
        _set(
            x=_upd_x3d(4),
            conv_state=_pool(state_len=5),
            num_accepted_tokens=lambda kw, d: _i32([1, 1, 1], d),
        ),
        r"conv_states?|num_accepted_tokens",
        False,
    ),
    (
        "query_start_loc_int64",
        _then(_varlen((2, 1, 3)), _set(query_start_loc=lambda kw, d: kw["query_start_loc"].long())),
        r"query_start_loc",
        False,
    ),
    (
        "query_start_loc_batch_mismatch",
        _varlen((2, 1, 3, 1)),
        r"query_start_loc|conv_state_indices",
        False,
    ),
    (
        "query_start_loc_with_3d_x",
        _set(x=_upd_x3d(2), query_start_loc=lambda kw, d: qsl_from_lens((2, 2, 2), d)),
        r"\bx\b|query_start_loc",
        False,
    ),
    ("activation_relu", _set(activation=lambda kw, d: "relu"), r"activation", False),
    (
        "conv_state_indices_strided",
        _set(conv_state_indices=lambda kw, d: _strided(kw["conv_state_indices"])),
        r"conv_state_indices",
        False,
    ),
    (
        "num_accepted_tokens_strided",
        _set(num_accepted_tokens=lambda kw, d: _strided(_i32([1, 2, 1], d))),
        r"num_accepted_tokens",
        False,
    ),
    (
        "query_start_loc_strided",
        _then(
            _varlen((2, 1, 3)),
            _set(query_start_loc=lambda kw, d: _strided(kw["query_start_loc"])),
        ),
        r"query_start_loc",
        False,
    ),
    *MARKER_ERRORS,
    # validate_data=True
    (
        "num_accepted_tokens_zero",
        _set(num_accepted_tokens=lambda kw, d: _i32([1, 0, 1], d)),
        r"num_accepted_tokens",
        True,
    ),
    (
        # history window [a-1, a-1+W-1) past state_len 8: a = 7 -> columns 6..8
        "num_accepted_tokens_past_state",
        _set(num_accepted_tokens=lambda kw, d: _i32([1, 7, 1], d)),
        r"num_accepted_tokens",
        True,
    ),
    (
        "conv_state_indices_out_of_range",
        _set(conv_state_indices=lambda kw, d: _i32([3, LINES, 1], d)),
        r"conv_state_indices",
        True,
    ),
    (
        "conv_state_indices_duplicate",
        _set(conv_state_indices=lambda kw, d: _i32([1, 2, 1], d)),
        r"conv_state_indices",
        True,
    ),
    (
        "query_start_loc_decreasing",
        _then(_varlen((2, 1, 3)), _set(query_start_loc=lambda kw, d: _i32([0, 3, 2, 6], d))),
        r"query_start_loc",
        True,
    ),
    (
        "query_start_loc_not_from_0",
        _then(_varlen((2, 1, 3)), _set(query_start_loc=lambda kw, d: _i32([1, 3, 4, 6], d))),
        r"query_start_loc",
        True,
    ),
    (
        "query_start_loc_last_not_num_tokens",
        _then(_varlen((2, 1, 3)), _set(query_start_loc=lambda kw, d: _i32([0, 2, 3, 5], d))),
        r"query_start_loc",
        True,
    ),
]
