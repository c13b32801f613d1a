#!/usr/bin/env python3
"""Greedy generation with Hugging Face transformers, flashattn_ext as the attention,
checked token for token against transformers' own "sdpa" implementation.

    python examples/hf_generate.py                         # tiny Llama, CPU, float32, seconds
    python examples/hf_generate.py --device cuda           # a larger Llama in bf16
    python examples/hf_generate.py --json out.json         # the results as JSON

The model is a randomly initialised Llama (GQA: fewer key/value heads than query heads)
built in code, nothing is downloaded. flashattn_ext joins transformers through its
attention interface:

    import flashattn_ext.hf
    name = flashattn_ext.hf.register()          # "fa_ext"
    model = LlamaForCausalLM(config)            # or from_pretrained(..., attn_implementation=name)
    model.set_attn_implementation(name)
    model.generate(input_ids, attention_mask=mask, do_sample=False)

Cases: one unpadded prompt (batch 1), and a batch of prompts of different lengths,
left-padded with an attention_mask (the padded path: varlen on the unpadded tokens).
For each case both implementations generate greedily from the same weights; then

* tokens: the generated sequences must be identical. Should they part, it must be at
  a step whose logits still agree within the tolerance rule (a near-tie that
  rounding decides: the check below fails otherwise);
* logits: each step's logits (up to where the sequences part) against a float64
  copy of the model run teacher-forced on the same tokens (the oracle), the yardstick
  being sdpa's error in the same dtype: flashattn_ext.tolerance.compare, the project's
  one rule (|ours - oracle| <= 2 |sdpa - oracle| + floor * max|oracle|);
* time: generate() wall time of each, median of --reps runs after a warm-up.

Exit status 0 when every case passes.
"""

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

# An installed flashattn_ext (pip install -e .) or one on PYTHONPATH wins; else the
# checkout this example lives in, built in place.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "flashattn_ext")):
    sys.path.append(_ROOT)

import flashattn_ext  # noqa: E402
import flashattn_ext.hf  # noqa: E402
from flashattn_ext import tolerance  # noqa: E402

PAD_ID = 0


def tiny_llama(device):
    """A Llama built in code: GQA 4:1 (query heads : key/value heads)."""
    from transformers import LlamaConfig

    if device.type == "cuda":
        sizes = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16)
        sizes.update(num_key_value_heads=4, vocab_size=4096)  # head_dim 64
    else:
        sizes = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8)
        sizes.update(num_key_value_heads=2, vocab_size=512)  # head_dim 16
    return LlamaConfig(
        **sizes,
        max_position_embeddings=2048,
        pad_token_id=PAD_ID,
        bos_token_id=1,
        eos_token_id=None,
        tie_word_embeddings=False,
    )


def build_model(config, dtype, device, seed):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Random weights of std 0.02 give near-uniform next-token distributions (ties);
    # larger ones give a model with decided preferences, as a trained one has.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
    model = model.to(device=device, dtype=dtype).eval()
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    return model


def make_prompts(lengths, vocab, device, gen):
    """Left-padded prompts of the given lengths: (input_ids, attention_mask), both (batch, max_len)."""
    n = max(lengths)
    ids = torch.full((len(lengths), n), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(lengths), n), dtype=torch.long)
    for i, length in enumerate(lengths):
        ids[i, n - length :] = torch.randint(2, vocab, (length,), generator=gen)
        mask[i, n - length :] = 1
    return ids.to(device), mask.to(device)


def generate(model, impl, ids, mask, new_tokens):
    """Greedy generate() with attention implementation `impl`: (sequences, logits (steps, batch, vocab))."""
    model.set_attn_implementation(impl)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences, torch.stack(out.logits)


def oracle_logits(model, seqs, mask, new_tokens):
    """The logits of each generation step, teacher-forced through a float64 copy with
    torch's math SDPA: (steps, batch, vocab)."""
    ref = copy.deepcopy(model).to(torch.float64)
    ref.set_attn_implementation("sdpa")
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], new_tokens)], dim=1)
    with torch.no_grad():
        logits = ref(seqs, attention_mask=full_mask).logits  # (batch, prompt + new, vocab)
    prompt = mask.shape[1]
    # The logits at position p predict token p + 1: step s is position prompt - 1 + s.
    return logits[:, prompt - 1 : prompt - 1 + new_tokens].transpose(0, 1)


def compare_generation(model, impl, ids, mask, new_tokens):
    """Runs sdpa and `impl` and checks them (see the module docstring). Returns a dict with `ok`."""
    prompt = ids.shape[1]
    seq_ref, logits_ref = generate(model, "sdpa", ids, mask, new_tokens)
    seq_ours, logits_ours = generate(model, impl, ids, mask, new_tokens)
    new_ref, new_ours = seq_ref[:, prompt:], seq_ours[:, prompt:]
    differs = new_ref != new_ours  # (batch, steps)
    # First step at which each row parts (new_tokens when it never does): up to and
    # including it, both runs saw the same tokens, so their logits are comparable.
    first = torch.where(
        differs.any(1), differs.int().argmax(1), torch.full_like(differs[:, 0], new_tokens, dtype=torch.long)
    )
    oracle = oracle_logits(model, seq_ref, mask, new_tokens)
    steps = torch.arange(new_tokens, device=ids.device)[:, None]
    same_prefix = (steps <= first[None, :]) & (steps < new_tokens)  # (steps, batch)
    cmp = tolerance.compare("logits", logits_ours[same_prefix], oracle[same_prefix], logits_ref[same_prefix])
    identical = not bool(differs.any())
    return dict(
        ok=cmp.ok,
        identical_tokens=identical,
        tokens_generated=int(new_ref.numel()),
        tokens_agreeing=int((~differs).sum()),
        first_divergence=[int(x) if x < new_tokens else None for x in first.tolist()],
        logits=cmp.as_dict(),
        logits_message=cmp.message(),
        sequences_sdpa=new_ref.tolist(),
        sequences_ours=new_ours.tolist(),
    )


def time_generate(model, impl, ids, mask, new_tokens, reps):
    """Median wall time (ms) of greedy generate() with `impl`, after one warm-up run."""
    model.set_attn_implementation(impl)
    times = []
    with torch.no_grad():
        for i in range(reps + 1):
            if ids.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
            if ids.device.type == "cuda":
                torch.cuda.synchronize()
            if i:  # the first run warms up (allocations, kernel selection)
                times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda when present")
    p.add_argument(
        "--dtype",
        choices=("float32", "float64", "bfloat16", "float16"),
        default=None,
        help="model dtype (default float32 on the CPU, bfloat16 on CUDA)",
    )
    p.add_argument("--new-tokens", type=int, default=None, help="tokens to generate (default 24 CPU, 64 CUDA)")
    p.add_argument("--reps", type=int, default=3, help="timed generate() runs per implementation (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the results here")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    new_tokens = args.new_tokens or (64 if cuda else 24)
    impl = flashattn_ext.hf.register()
    config = tiny_llama(device)
    model = build_model(config, dtype, device, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    cases = {
        "batch 1, no padding": [96 if cuda else 20],
        "padded batch (left padding)": [128, 37, 90, 5, 64, 111, 12, 128] if cuda else [20, 7, 13, 1],
    }
    report = dict(
        device=torch.cuda.get_device_name(device) if cuda else "cpu",
        dtype=str(dtype).replace("torch.", ""),
        torch=torch.__version__,
        transformers=__import__("transformers").__version__,
        flashattn_ext_build=flashattn_ext.build_info(),
        model=dict(
            layers=config.num_hidden_layers,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=config.hidden_size // config.num_attention_heads,
            vocab=config.vocab_size,
        ),
        new_tokens=new_tokens,
        cases={},
    )
    print(
        f"hf_generate: {report['device']}, {report['dtype']}, transformers {report['transformers']}, "
        f"Llama {report['model']}, {new_tokens} new tokens"
    )
    ok = True
    for name, lengths in cases.items():
        ids, mask = make_prompts(lengths, config.vocab_size, device, gen)
        res = compare_generation(model, impl, ids, mask, new_tokens)
        res["prompt_lengths"] = lengths
        res["ms_sdpa"] = time_generate(model, "sdpa", ids, mask, new_tokens, args.reps)
        res["ms_ours"] = time_generate(model, impl, ids, mask, new_tokens, args.reps)
        report["cases"][name] = res
        ok &= res["ok"]
        agree = "identical" if res["identical_tokens"] else f"part at steps {res['first_divergence']}"
        print(
            f"  {name} (prompt lengths {lengths}): tokens {res['tokens_agreeing']}/{res['tokens_generated']} "
            f"agree ({agree}); {res['logits_message']}; "
            f"generate {res['ms_ours']:.1f} ms ours vs {res['ms_sdpa']:.1f} ms sdpa -> {'ok' if res['ok'] else 'FAIL'}"
        )
    report["ok"] = ok
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    print("hf_generate: " + ("ok" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
