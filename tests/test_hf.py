"""flashattn_ext as a Hugging Face transformers attention implementation
(flashattn_ext.hf): greedy generation against transformers' "sdpa" on a small
random Llama (GQA), unpadded, left-padded, with a static cache and a sliding window;
packed sequences; the errors. The checks are examples/hf_generate.py's (tokens
identical, or parting only where the logits agree within flashattn_ext.tolerance's
rule against a float64 oracle). Skipped without transformers."""

import copy
import importlib.util
import os
import warnings
from collections import Counter

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -r requirements.txt brings it)"
)

import flashattn_ext  # noqa: E402
import flashattn_ext.hf  # noqa: E402
from flashattn_ext import interface, tolerance  # noqa: E402

_EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "hf_generate.py")
_spec = importlib.util.spec_from_file_location("hf_generate", _EXAMPLE)
hf_generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_generate)

IMPL = flashattn_ext.hf.register()


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls of flashattn_ext's functions made by the integration, so a
    test sees that our kernels ran (not transformers' sdpa by some fallback)."""
    counter = Counter()
    for name in ("flash_attn_func", "flash_attn_varlen_func", "scaled_dot_product_attention"):
        fn = getattr(interface, name)

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            counter[_name] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(interface, name, wrapped)
    return counter


def _model(device, dtype, seed, **config):
    cfg = hf_generate.tiny_llama(torch.device("cpu"))  # the CPU's small sizes: enough for the test, on CUDA too
    for k, v in config.items():
        setattr(cfg, k, v)
    return cfg, hf_generate.build_model(cfg, dtype, torch.device(device), seed)


def _check(res, dtype):
    assert res["ok"], res["logits_message"]
    if dtype == torch.float64:
        # float64: a tie within rounding is out of reach, the tokens must be identical.
        assert res["identical_tokens"], (res["sequences_sdpa"], res["sequences_ours"])


@pytest.mark.dtypes(torch.float32, torch.float64, torch.bfloat16, torch.float16)
@pytest.mark.parametrize("lengths", [[19], [20, 7, 13, 1]], ids=["batch1", "left_padded"])
def test_generate_agrees_with_sdpa(device, dtype, lengths, calls, _seed):
    cfg, model = _model(device, dtype, _seed)
    ids, mask = hf_generate.make_prompts(
        lengths, cfg.vocab_size, torch.device(device), torch.Generator().manual_seed(_seed)
    )
    res = hf_generate.compare_generation(model, IMPL, ids, mask, new_tokens=12)
    _check(res, dtype)
    # Prefill plus one call per new token and layer, all ours: flash_attn_func without
    # padding, the varlen function on the unpadded tokens with it.
    used = "flash_attn_varlen_func" if len(lengths) > 1 else "flash_attn_func"
    assert calls[used] == 12 * cfg.num_hidden_layers, dict(calls)
    assert calls["scaled_dot_product_attention"] == 0


@pytest.mark.dtypes(torch.float32, torch.bfloat16)
@pytest.mark.parametrize("lengths", [[19], [20, 7, 13, 1]], ids=["batch1", "left_padded"])
def test_generate_static_cache(device, dtype, lengths, calls, _seed):
    """A static cache holds max_cache_len slots, most not yet written: flashattn_ext.hf.padding_mask
    makes the attention read only the written ones."""
    cfg, model = _model(device, dtype, _seed)
    model.generation_config.cache_implementation = "static"
    ids, mask = hf_generate.make_prompts(
        lengths, cfg.vocab_size, torch.device(device), torch.Generator().manual_seed(_seed)
    )
    res = hf_generate.compare_generation(model, IMPL, ids, mask, new_tokens=8)
    _check(res, dtype)
    # The varlen function while the cache has unwritten slots; flash_attn_func on the
    # last step, which fills it.
    assert calls["flash_attn_varlen_func"] + calls["flash_attn_func"] == 8 * cfg.num_hidden_layers, dict(calls)
    assert calls["flash_attn_varlen_func"] >= 7 * cfg.num_hidden_layers, dict(calls)


@pytest.mark.dtypes(torch.float32)
def test_generate_sliding_window(device, dtype, calls, _seed):
    """Mistral-style sliding window (6 tokens) over prompts longer than it."""
    from transformers import MistralConfig, MistralForCausalLM

    base = hf_generate.tiny_llama(torch.device("cpu"))
    cfg = MistralConfig(
        **{
            k: getattr(base, k)
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "vocab_size",
                "pad_token_id",
                "bos_token_id",
                "eos_token_id",
            )
        },
        sliding_window=6,
    )
    torch.manual_seed(_seed)
    model = MistralForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
    model = model.to(device=device, dtype=dtype).eval()
    model.generation_config.pad_token_id = cfg.pad_token_id
    model.generation_config.eos_token_id = None
    for lengths in ([17], [17, 5, 11]):
        ids, mask = hf_generate.make_prompts(
            lengths, cfg.vocab_size, torch.device(device), torch.Generator().manual_seed(_seed)
        )
        _check(hf_generate.compare_generation(model, IMPL, ids, mask, new_tokens=8), dtype)
    assert sum(calls.values()) > 0


@pytest.mark.dtypes(torch.float64, torch.bfloat16)
def test_packed_sequences_position_ids(device, dtype, calls, _seed):
    """Sequences packed in one row, position_ids restarting at each (padding-free
    batches): each attends to itself only, as if run alone."""
    cfg, model = _model(device, dtype, _seed)
    gen = torch.Generator().manual_seed(_seed)
    lengths = [9, 4, 14]
    seqs = [torch.randint(2, cfg.vocab_size, (n,), generator=gen).to(device) for n in lengths]
    packed = torch.cat(seqs)[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    model.set_attn_implementation(IMPL)
    with torch.no_grad():
        ours = model(packed, position_ids=position_ids).logits[0]
        model.set_attn_implementation("sdpa")
        naive = torch.cat([model(s[None]).logits[0] for s in seqs])
        oracle_model = copy.deepcopy(model).to(torch.float64)
        oracle = torch.cat([oracle_model(s[None]).logits[0] for s in seqs])
    assert calls["flash_attn_varlen_func"] == cfg.num_hidden_layers
    c = tolerance.compare("logits", ours, oracle, naive)
    assert c.ok, c.message()


def _tiny_gemma2(device, dtype, seed, sliding_window):
    """A randomly initialized Gemma 2 built in code (nothing downloaded): attention logit
    softcapping, alternating sliding / full layers, GQA 2:1."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        sliding_window=sliding_window,
        # Small enough a cap that the softcap changes the scores (Gemma 2's is 50 on
        # real logits); the random weights give logits of a few units.
        attn_logit_softcapping=2.0,
        final_logit_softcapping=None,
        query_pre_attn_scalar=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = Gemma2ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 3.0 / p.shape[1] ** 0.5)  # larger logits: the cap matters
    return cfg, model.to(device=device, dtype=dtype).eval()


@pytest.mark.dtypes(torch.float32, torch.bfloat16)
@pytest.mark.parametrize("lengths", [[19], [20, 7, 13]], ids=["batch1", "left_padded"])
def test_gemma2_softcap_agrees_with_eager(device, dtype, lengths, calls, _seed):
    """Gemma 2 (softcap = attn_logit_softcapping, sliding window 8 < the prompts) through our
    kernels against transformers' eager attention: the logits of every real token."""
    cfg, model = _tiny_gemma2(device, dtype, _seed, sliding_window=8)
    ids, mask = hf_generate.make_prompts(
        lengths, cfg.vocab_size, torch.device(device), torch.Generator().manual_seed(_seed)
    )
    logits = {}
    for impl in ("eager", IMPL):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            logits[impl] = model(ids, attention_mask=mask).logits.float()
    real = mask.bool()
    ours, ref = logits[IMPL][real], logits["eager"][real]
    # As hf_generate.compare_generation: a float64 copy (eager) is the oracle, this
    # dtype's eager run the naive baseline of the rule.
    model64 = copy.deepcopy(model).to(torch.float64)
    model64.set_attn_implementation("eager")
    with torch.no_grad():
        oracle = model64(ids, attention_mask=mask).logits[real]
    c = tolerance.compare("logits", ours, oracle, ref)
    assert c.ok, c.message()
    assert calls["flash_attn_func"] + calls["flash_attn_varlen_func"] == cfg.num_hidden_layers, dict(calls)
    assert calls["scaled_dot_product_attention"] == 0
    # The cap matters here: without it the kernels' logits are farther off.
    model.set_attn_implementation(IMPL)
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    with torch.no_grad():
        uncapped = model(ids, attention_mask=mask).logits.float()[real]
    assert tolerance.max_err(uncapped, oracle) > 4 * tolerance.max_err(ours, oracle)


def test_errors():
    with pytest.raises(ValueError, match="name='my_flash'.*choose another"):
        flashattn_ext.hf.register("my_flash")
    q = torch.randn(1, 4, 3, 16)
    k = torch.randn(1, 2, 3, 16)
    module = torch.nn.Module()
    with pytest.raises(NotImplementedError, match="softcap=50.0 with a dense 4-D attention mask"):
        flashattn_ext.hf.attention_forward(module, q, k, k, torch.ones(1, 1, 3, 3, dtype=torch.bool), softcap=50.0)
    with pytest.raises(NotImplementedError, match="s_aux"):
        flashattn_ext.hf.attention_forward(module, q, k, k, None, s_aux=torch.zeros(4))
    with pytest.raises(NotImplementedError, match="block_table"):
        flashattn_ext.hf.attention_forward(module, q, k, k, None, block_table=torch.zeros(1, 1, dtype=torch.int32))


def test_attention_forward_layout_and_dense_mask(calls):
    """The function alone: (batch, heads, seqlen, head_dim) in, (batch, seqlen, heads,
    head_dim) out, equal to torch's SDPA (GQA, bottom-right causal = top-left when the
    lengths are equal); a dense 4-D mask goes to our kernels through the SDPA drop-in."""
    q = torch.randn(2, 4, 7, 16, dtype=torch.float64)
    k, v = torch.randn(2, 2, 7, 16, dtype=torch.float64), torch.randn(2, 2, 7, 16, dtype=torch.float64)
    module = torch.nn.Module()
    module.is_causal = True
    out, weights = flashattn_ext.hf.attention_forward(module, q, k, v, None, scaling=0.3)
    assert weights is None and out.shape == (2, 7, 4, 16)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    c = tolerance.compare("out", out, ref.transpose(1, 2), ref.transpose(1, 2))
    assert c.ok, c.message()
    mask = torch.rand(2, 1, 7, 7) > 0.3
    mask[..., 0] = True  # every row sees a key
    with warnings.catch_warnings():
        warnings.simplefilter("error", flashattn_ext.FlashAttnFallbackWarning)  # no fallback: the kernels run
        out, _ = flashattn_ext.hf.attention_forward(module, q, k, v, mask)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    c = tolerance.compare("out", out, ref.transpose(1, 2), ref.transpose(1, 2))
    assert c.ok, c.message()
    assert calls["scaled_dot_product_attention"] == 1
