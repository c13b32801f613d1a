"""The bad-input table (issue #9): every kind of invalid or unsupported input we
know of, and what it must do, on the CPU and on CUDA (the `device` fixture):

* ``Raises(exc, regex)``: a clear error of that type whose message names the
  argument (and says what to do);
* ``LIKE_TORCH`` (the SDPA drop-in only): exactly what
  torch.nn.functional.scaled_dot_product_attention does with the same call:
  the same exception type and message, or the same output (a fallback
  warning allowed).

No input, valid or not, may crash the process. Each row is one test per device
(``test_bad_input[cpu-<kind>]``); rows marked ``cpu_only`` need a tensor kind
that exists on the CPU only (mkldnn, quantized). The op-level checks of the
backward (dout, out, lse) are the BWD_CASES table of tests/test_errors.py, and
the forward op's FWD_CASES run there through the real and the meta kernels.
"""

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from flashattn_ext import FlashAttnFallbackWarning
from flashattn_ext import flash_attn_func as faf
from flashattn_ext import scaled_dot_product_attention as sdpa

np = pytest.importorskip("numpy")


@dataclass
class Raises:
    exc: type
    match: str


LIKE_TORCH = "like torch"


@dataclass
class Case:
    api: str  # "faf" | "sdpa"
    build: Callable  # (device, dtype) -> (args, kwargs)
    expect: object  # Raises | LIKE_TORCH | a callable (device) -> Raises | LIKE_TORCH
    cpu_only: bool = False


def _dt(device):
    return torch.float32 if device == "cpu" else torch.float16


def bshd(device, b=2, s=5, h=4, d=16, dtype=None):
    return torch.randn(b, s, h, d, device=device).to(dtype or _dt(device))


def qkv(device, sq=5, sk=7, hq=4, hk=2, d=16, dtype=None):
    return bshd(device, 2, sq, hq, d, dtype), bshd(device, 2, sk, hk, d, dtype), bshd(device, 2, sk, hk, d, dtype)


def bhsd(device, **kw):
    return tuple(x.transpose(1, 2) for x in qkv(device, **kw))


def F_(fn):  # faf call with modified q, k, v
    return lambda dev: (fn(*qkv(dev)), {})


def Fkw(**kw):  # faf call with keyword arguments
    return lambda dev: (qkv(dev), kw)


def S_(fn, **kw):  # sdpa call
    return lambda dev: (fn(*bhsd(dev, hk=4)), kw)


def Skw(**kw):
    return lambda dev: (bhsd(dev, hk=4), kw)


def _expand_long(x, dim):
    shape = list(x.shape)
    shape[dim] = 2**31
    idx = [slice(None)] * x.dim()
    idx[dim] = slice(0, 1)
    return x[tuple(idx)].expand(*shape)  # stride 0: no memory


V = ValueError
T = TypeError

CASES = {
    # --------------------------------------------------------------- flash_attn_func: tensor arguments
    "faf_q_numpy": Case(
        "faf",
        lambda d: ((qkv(d)[0].cpu().float().numpy(),) + qkv(d)[1:], {}),
        Raises(T, r"q must be a torch.Tensor, got numpy.ndarray; convert it with torch.from_numpy"),
    ),
    "faf_k_list": Case("faf", F_(lambda q, k, v: (q, [[1.0]], v)), Raises(T, r"k must be a torch.Tensor, got list")),
    "faf_v_none": Case("faf", F_(lambda q, k, v: (q, k, None)), Raises(T, r"v must be a torch.Tensor, got NoneType")),
    "faf_q_scalar": Case("faf", F_(lambda q, k, v: (q[0, 0, 0, 0], k, v)), Raises(V, r"q must have 4 dimensions")),
    "faf_q_rank1": Case("faf", F_(lambda q, k, v: (q[0, 0, 0], k, v)), Raises(V, r"q must have 4 dimensions")),
    "faf_q_rank3_bhd": Case("faf", F_(lambda q, k, v: (q[0], k, v)), Raises(V, r"q must have 4 dimensions")),
    "faf_k_rank5": Case("faf", F_(lambda q, k, v: (q, k[None], v)), Raises(V, r"k must have 4 dimensions")),
    "faf_v_rank2": Case("faf", F_(lambda q, k, v: (q, k, v[0, 0])), Raises(V, r"v must have 4 dimensions")),
    "faf_k_dtype": Case(
        "faf", F_(lambda q, k, v: (q, k.double(), v)), Raises(T, r"k has dtype Double but q has dtype")
    ),
    "faf_v_dtype": Case(
        "faf",
        F_(lambda q, k, v: (q, k, v.to(torch.bfloat16 if q.dtype != torch.bfloat16 else torch.float16))),
        Raises(T, r"v has dtype \w+ but q has dtype"),
    ),
    "faf_int": Case(
        "faf",
        F_(lambda q, k, v: (q.int(), k.int(), v.int())),
        Raises(T, r"q has dtype Int, which the \w+ kernels do not support"),
    ),
    "faf_bool": Case(
        "faf", F_(lambda q, k, v: (q > 0, k > 0, v > 0)), Raises(T, r"q has dtype Bool, which the \w+ kernels")
    ),
    "faf_complex": Case(
        "faf",
        F_(lambda q, k, v: tuple(torch.complex(x.float(), x.float()) for x in (q, k, v))),
        Raises(T, r"q has dtype ComplexFloat, which the \w+ kernels"),
    ),
    "faf_float32_or_64": Case(
        "faf",
        F_(lambda q, k, v: (q.double(), k.double(), v.double())),
        lambda dev: None if dev == "cpu" else Raises(T, r"q has dtype Double, which the CUDA kernels do not support"),
    ),
    "faf_zero_head_dim": Case(
        "faf", F_(lambda q, k, v: (q[..., :0], k[..., :0], v[..., :0])), Raises(V, r"q has head_dim 0")
    ),
    "faf_k_head_dim": Case(
        "faf", F_(lambda q, k, v: (q, k[..., :8], v)), Raises(V, r"k has head_dim 8 but q has head_dim 16")
    ),
    "faf_v_head_dim": Case("faf", F_(lambda q, k, v: (q, k, v[..., :8])), Raises(V, r"v has head_dim 8 but q has 16")),
    "faf_head_dim_264": Case(
        "faf",
        lambda d: (tuple(torch.zeros(1, 3, 2, 264, device=d, dtype=_dt(d)) for _ in range(3)), {}),
        Raises(V, r"head_dim 264 is larger than 256"),
    ),
    "faf_batch": Case("faf", F_(lambda q, k, v: (q, k[:1], v[:1])), Raises(V, r"batch sizes differ: q 2, k 1, v 1")),
    "faf_kv_seqlen": Case("faf", F_(lambda q, k, v: (q, k, v[:, :3])), Raises(V, r"v has seqlen 3 but k has 7")),
    "faf_kv_heads": Case("faf", F_(lambda q, k, v: (q, k, v[:, :, :1])), Raises(V, r"v has 1 heads but k has 2")),
    "faf_heads_not_divisible": Case(
        "faf", F_(lambda q, k, v: (q[:, :, :3], k, v)), Raises(V, r"q has 3 heads, not a multiple of the 2 heads")
    ),
    "faf_q_too_long": Case(
        "faf", F_(lambda q, k, v: (_expand_long(q, 1), k, v)), Raises(V, r"q dimension 1 has size 2147483648")
    ),
    "faf_k_too_long": Case(
        "faf",
        F_(lambda q, k, v: (q, _expand_long(k, 1), _expand_long(v, 1))),
        Raises(V, r"k dimension 1 has size 2147483648"),
    ),
    "faf_k_meta": Case(
        "faf", F_(lambda q, k, v: (q, k.to("meta"), v.to("meta"))), Raises(V, r"k is on meta but q is on (cpu|cuda)")
    ),
    "faf_q_meta": Case(
        "faf", F_(lambda q, k, v: (q.to("meta"), k, v)), Raises(V, r"k is on (cpu|cuda:\d) but q is on meta")
    ),
    "faf_v_other_device": Case(
        "faf",
        F_(lambda q, k, v: (q, k, v.cpu() if v.is_cuda else v.to("meta"))),
        Raises(V, r"v is on (cpu|meta) but q is on (cpu|cuda:\d)"),
    ),
    "faf_q_sparse": Case(
        "faf", F_(lambda q, k, v: (q.to_sparse(), k, v)), Raises(T, r"q has layout Sparse; the kernels take dense")
    ),
    "faf_v_sparse_csr": Case(
        "faf", F_(lambda q, k, v: (q, k, v[0, 0].to_sparse_csr())), Raises(T, r"v has layout SparseCsr")
    ),
    "faf_q_nested": Case(
        "faf",
        lambda d: (
            (torch.nested.nested_tensor([torch.randn(5, 2, 16), torch.randn(3, 2, 16)], layout=torch.jagged, device=d),)
            * 3,
            {},
        ),
        Raises(T, r"q is a nested tensor"),
    ),
    "faf_q_mkldnn": Case(
        "faf",
        F_(lambda q, k, v: (q.float().to_mkldnn(), k.float(), v.float())),
        Raises(T, r"q has layout Mkldnn"),
        cpu_only=True,
    ),
    "faf_k_quantized": Case(
        "faf",
        F_(lambda q, k, v: (q, torch.quantize_per_tensor(k.float(), 0.1, 0, torch.qint8), v)),
        Raises(T, r"k is quantized"),
        cpu_only=True,
    ),
    # --------------------------------------------------------------- flash_attn_func: other arguments
    "faf_causal_str": Case("faf", Fkw(causal="False"), Raises(T, r"causal must be a bool, got str 'False'")),
    "faf_causal_int": Case("faf", Fkw(causal=1), Raises(T, r"causal must be a bool, got int 1")),
    "faf_causal_none": Case("faf", Fkw(causal=None), Raises(T, r"causal must be a bool, got NoneType")),
    "faf_deterministic_str": Case("faf", Fkw(deterministic="yes"), Raises(T, r"deterministic must be a bool")),
    "faf_return_lse_int": Case("faf", Fkw(return_lse=1), Raises(T, r"return_lse must be a bool")),
    "faf_window_int": Case(
        "faf", Fkw(window_size=128), Raises(T, r"window_size must be a pair \(left, right\) of ints.*got int 128")
    ),
    "faf_window_none": Case("faf", Fkw(window_size=None), Raises(T, r"window_size must be a pair .*got NoneType")),
    "faf_window_triple": Case("faf", Fkw(window_size=(1, 2, 3)), Raises(T, r"window_size must be a pair")),
    "faf_window_str": Case("faf", Fkw(window_size="ab"), Raises(T, r"window_size must be a pair")),
    "faf_window_float": Case(
        "faf", Fkw(window_size=(1.5, 0)), Raises(T, r"window_size \(left\) must be an int, got float 1.5")
    ),
    "faf_window_bool": Case(
        "faf", Fkw(window_size=(True, 0)), Raises(T, r"window_size \(left\) must be an int, got bool")
    ),
    "faf_window_negative": Case(
        "faf", Fkw(window_size=(0, -2)), Raises(V, r"window_size \(right\) must be -1 \(unbounded\) or >= 0, got -2")
    ),
    "faf_dropout_negative": Case("faf", Fkw(dropout_p=-0.5), Raises(V, r"dropout_p must be in \[0, 1\], got -0.5")),
    "faf_dropout_above_1": Case("faf", Fkw(dropout_p=1.5), Raises(V, r"dropout_p must be in \[0, 1\], got 1.5")),
    "faf_dropout_nan": Case("faf", Fkw(dropout_p=math.nan), Raises(V, r"dropout_p must be in \[0, 1\], got nan")),
    "faf_dropout_str": Case("faf", Fkw(dropout_p="0.1"), Raises(T, r"dropout_p must be a real number, got str")),
    "faf_scale_nan": Case("faf", Fkw(softmax_scale=math.nan), Raises(V, r"softmax_scale must be finite, got nan")),
    "faf_scale_inf": Case("faf", Fkw(softmax_scale=-math.inf), Raises(V, r"softmax_scale must be finite, got -inf")),
    "faf_scale_str": Case("faf", Fkw(softmax_scale="0.1"), Raises(T, r"softmax_scale must be a real number, got str")),
    "faf_scale_complex": Case(
        "faf", Fkw(softmax_scale=1j), Raises(T, r"softmax_scale must be a real number, got complex")
    ),
    "faf_softcap": Case("faf", Fkw(softcap=-1.0), Raises(V, r"softcap must be a finite number >= 0")),
    "faf_softcap_str": Case("faf", Fkw(softcap="x"), Raises(T, r"softcap must be a real number")),
    "faf_alibi": Case("faf", Fkw(alibi_slopes=[1.0]), Raises(T, r"alibi_slopes must be None or a float32")),
    "faf_return_attn_probs": Case("faf", Fkw(return_attn_probs=True), None),  # served (S_dmask; None without dropout)
    # --------------------------------------------------------------- the SDPA drop-in: torch's behaviour
    "sdpa_query_numpy": Case("sdpa", lambda d: ((bhsd(d)[0].cpu().float().numpy(),) + bhsd(d)[1:], {}), LIKE_TORCH),
    "sdpa_key_none": Case("sdpa", S_(lambda q, k, v: (q, None, v)), LIKE_TORCH),
    "sdpa_is_causal_int": Case("sdpa", Skw(is_causal=1), LIKE_TORCH),
    "sdpa_is_causal_str": Case("sdpa", Skw(is_causal="False"), LIKE_TORCH),
    "sdpa_enable_gqa_str": Case("sdpa", Skw(enable_gqa="yes"), LIKE_TORCH),
    "sdpa_scale_str": Case("sdpa", Skw(scale="0.1"), LIKE_TORCH),
    "sdpa_scale_nan": Case("sdpa", Skw(scale=math.nan), LIKE_TORCH),
    "sdpa_scale_inf": Case("sdpa", Skw(scale=math.inf), LIKE_TORCH),
    "sdpa_scale_tensor": Case("sdpa", Skw(scale=torch.tensor(0.3)), LIKE_TORCH),
    "sdpa_dropout_str": Case("sdpa", Skw(dropout_p="0.1"), LIKE_TORCH),
    "sdpa_dropout_negative": Case(
        "sdpa", Skw(dropout_p=-0.5), Raises(RuntimeError, r"dropout_p has to be between 0 and 1")
    ),
    "sdpa_dropout_above_1": Case(
        "sdpa", Skw(dropout_p=1.5), Raises(RuntimeError, r"dropout_p has to be between 0 and 1")
    ),
    "sdpa_dropout_nan": Case(
        "sdpa", Skw(dropout_p=math.nan), Raises(RuntimeError, r"dropout_p has to be between 0 and 1")
    ),
    "sdpa_rank1": Case("sdpa", S_(lambda q, k, v: (q[0, 0, 0], k[0, 0, 0], v[0, 0, 0])), LIKE_TORCH),
    "sdpa_ranks_differ": Case("sdpa", S_(lambda q, k, v: (q, k[0], v[0])), LIKE_TORCH),
    "sdpa_dtypes_differ": Case("sdpa", S_(lambda q, k, v: (q, k.double(), v)), LIKE_TORCH),
    "sdpa_int": Case("sdpa", S_(lambda q, k, v: (q.int(), k.int(), v.int())), LIKE_TORCH),
    "sdpa_gqa_without_flag": Case("sdpa", S_(lambda q, k, v: (q, k[:, :2], v[:, :2])), LIKE_TORCH),
    "sdpa_gqa_not_divisible": Case("sdpa", S_(lambda q, k, v: (q, k[:, :3], v[:, :3]), enable_gqa=True), LIKE_TORCH),
    "sdpa_heads_differ": Case("sdpa", S_(lambda q, k, v: (q, k[:, :3], v[:, :2]), enable_gqa=True), LIKE_TORCH),
    "sdpa_batch_differs": Case("sdpa", S_(lambda q, k, v: (q, k[:1], v)), LIKE_TORCH),
    "sdpa_mask_shape": Case(
        "sdpa", lambda d: (bhsd(d, hk=4), {"attn_mask": torch.ones(6, 7, dtype=torch.bool, device=d)}), LIKE_TORCH
    ),
    # rank-3 inputs (B, L, E) take masks that broadcast to (B, L, S); a rank-4 one is torch's error
    "sdpa_rank3_mask_rank4": Case(
        "sdpa",
        lambda d: (
            tuple(x[:, 0] for x in bhsd(d, hk=4)),
            {"attn_mask": torch.zeros(2, 1, 5, 7, device=d, dtype=_dt(d))},
        ),
        LIKE_TORCH,
    ),
    "sdpa_rank3_bool_mask_rank4": Case(
        "sdpa",
        lambda d: (
            tuple(x[:, 0] for x in bhsd(d, hk=4)),
            {"attn_mask": torch.ones(1, 1, 5, 7, dtype=torch.bool, device=d)},
        ),
        LIKE_TORCH,
    ),
    "sdpa_mask_int": Case(
        "sdpa", lambda d: (bhsd(d, hk=4), {"attn_mask": torch.ones(5, 7, dtype=torch.int32, device=d)}), LIKE_TORCH
    ),
    "sdpa_mask_and_causal": Case(
        "sdpa",
        lambda d: (bhsd(d, hk=4), {"attn_mask": torch.ones(5, 7, dtype=torch.bool, device=d), "is_causal": True}),
        LIKE_TORCH,
    ),
    "sdpa_mask_meta": Case(
        "sdpa",
        lambda d: (bhsd(d, hk=4), {"attn_mask": torch.ones(5, 7, dtype=torch.bool, device="meta")}),
        Raises(RuntimeError, r"attn_mask is on meta but query is on (cpu|cuda:\d); move attn_mask"),
    ),
    "sdpa_key_meta": Case("sdpa", S_(lambda q, k, v: (q, k.to("meta"), v.to("meta"))), LIKE_TORCH),
    "sdpa_value_head_dim": Case("sdpa", S_(lambda q, k, v: (q, k, v[..., :8])), LIKE_TORCH),
    "sdpa_zero_length": Case("sdpa", S_(lambda q, k, v: (q[:, :, :0], k, v)), LIKE_TORCH),
    "sdpa_zero_keys": Case("sdpa", S_(lambda q, k, v: (q, k[:, :, :0], v[:, :, :0])), LIKE_TORCH),
    "sdpa_head_dim_512": Case(
        "sdpa", lambda d: (tuple(torch.randn(1, 2, 5, 512, device=d).to(_dt(d)) for _ in range(3)), {}), LIKE_TORCH
    ),
    "sdpa_rank5": Case("sdpa", S_(lambda q, k, v: (q[None], k[None], v[None])), LIKE_TORCH),
    "sdpa_sparse_query": Case("sdpa", S_(lambda q, k, v: (q.to_sparse(), k, v)), LIKE_TORCH),
    # Invalid inputs torch 2.11 mishandles (CPU: an answer, or uninitialised
    # memory for a meta mask; CUDA: a crash): our own errors.
    "sdpa_kv_lengths_differ": Case(
        "sdpa",
        S_(lambda q, k, v: (q, k, v[:, :, :3])),
        Raises(RuntimeError, r"key has 7 positions but value has 3; key and value must share"),
    ),
    "sdpa_key_head_dim": Case(
        "sdpa",
        S_(lambda q, k, v: (q, k[..., :8], v)),
        Raises(RuntimeError, r"key has head dim 8 but query has head dim 16"),
    ),
}


def _same_output(a, b):
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and (a.device.type == "meta" or torch.allclose(a.float(), b.float(), rtol=2e-3, atol=2e-3, equal_nan=True))
        )
    return a == b


@pytest.mark.parametrize("kind", list(CASES))
def test_bad_input(device, kind):
    case = CASES[kind]
    if case.cpu_only and device != "cpu":
        pytest.skip("this tensor kind exists on the CPU only")
    torch.manual_seed(0)
    args, kwargs = case.build(device)
    expect = case.expect(device) if callable(case.expect) else case.expect
    fn = faf if case.api == "faf" else sdpa
    if expect is None:  # valid on this device
        fn(*args, **kwargs)
        return
    if isinstance(expect, Raises):
        with pytest.raises(expect.exc, match=expect.match):
            fn(*args, **kwargs)
        return
    assert expect == LIKE_TORCH and case.api == "sdpa"
    torch_exc = torch_out = None
    try:
        torch.manual_seed(1)
        torch_out = F.scaled_dot_product_attention(*args, **kwargs)
    except Exception as e:  # noqa: BLE001  (whatever torch raises, we raise)
        torch_exc = e
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FlashAttnFallbackWarning)
        if torch_exc is not None:
            with pytest.raises(type(torch_exc)) as ours:
                sdpa(*args, **kwargs)
            assert str(ours.value) == str(torch_exc)
        else:
            torch.manual_seed(1)
            assert _same_output(sdpa(*args, **kwargs), torch_out)


def test_table_size():
    """The issue asks for at least 50 kinds, on CPU and CUDA."""
    assert len(CASES) >= 50
    assert sum(not c.cpu_only for c in CASES.values()) >= 50
