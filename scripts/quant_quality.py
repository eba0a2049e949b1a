"""How much do `--quantization int8`, `int4`, `w8a8` and `--block-activations int8` change the model?
Teacher-forced comparison with transformers.

Runs transformers on a text with the checkpoint's weights, then with every GEMM weight replaced by
Relay's int8 and int4 quantization of it: on the CPU block kernels a float checkpoint's blocks
(`relay.execution.quantized_blocks`: Q8_0's and Q4_1's rules per 32 inputs, float32 scales), with
float and with int8 block activations; elsewhere (a GGUF file, `--disable-weight-blocks`) torch's
kernels' (`relay.execution.layers.quantize_int8` / `quantize_int4`, dequantized). For w8a8 also
every decoder linear layer's input rounded as Relay's kernel rounds it (int8 per token,
csrc/w8a8.c), and for int8 block activations every linear layer's input, the LM head's too,
rounded to 8 bits per block of 32 (csrc/gemm_dot.c; this rounds Q4_1's m term's sums too, as
llama.cpp does, which Relay takes exactly: an upper bound). Reports top-1 agreement of the
next-token predictions, the mean KL divergence, and perplexity on the text.

    python scripts/quant_quality.py                    # default model, README.md + docs/*.md
    python scripts/quant_quality.py --model-path DIR --text some.txt --max-tokens 4096
"""

from __future__ import annotations

import argparse
import glob
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    from transformers import AutoTokenizer

    from relay.execution.layers import quantize_int4, quantize_int8, quantize_rows_int8
    from relay.execution.quantized_blocks import dequantized

    def round_rows_int8(
        x: torch.Tensor,
    ) -> torch.Tensor:  # x on its rows' int8 grids, as Relay's kernel rounds it
        q, s = quantize_rows_int8(x)
        return q * s

    def round_blocks_int8(
        x: torch.Tensor,
    ) -> torch.Tensor:  # x on int8 grids per block of 32 (csrc/gemm_dot.c)
        b = x.reshape(*x.shape[:-1], -1, 32)
        amax = b.abs().amax(-1, keepdim=True)
        inv = torch.full_like(amax, 127.0) / amax.clamp_min(1e-30)
        return (torch.round(b * inv) * (amax / 127)).reshape(x.shape)

    from relay.execution.model_files import load_transformers_model, resolve_model_dir

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-path", default=None)
    p.add_argument(
        "--text", nargs="*", default=None, help="text files (default: README.md and docs/*.md)"
    )
    p.add_argument("--max-tokens", type=int, default=2048)
    args = p.parse_args()

    model_dir = resolve_model_dir(args.model_path)
    paths = args.text or [
        os.path.join(ROOT, "README.md"),
        *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))),
    ]
    text = "\n\n".join(open(path).read() for path in paths)
    ids = AutoTokenizer.from_pretrained(model_dir)(text, return_tensors="pt").input_ids[
        :, : args.max_tokens
    ]
    model = load_transformers_model(model_dir, torch.float32).eval()
    original = {name: p.data.clone() for name, p in model.named_parameters() if p.dim() == 2}
    int8 = lambda w: quantize_int8(w)[1]  # noqa: E731
    same = lambda w: w  # noqa: E731
    q8_0 = lambda w: dequantized(w, "int8")  # noqa: E731
    q4_1 = lambda w: dequantized(w, "int4")  # noqa: E731
    blocks = "(--quantization {}: a float checkpoint on the block kernels)"
    schemes = [
        (f"int8 blocks, Q8_0 per 32 inputs {blocks.format('int8')}", q8_0, None),
        ("int8 blocks, int8 block activations (the default from AVX2 up)", q8_0, "blocks"),
        (f"int4 blocks, Q4_1 per 32 inputs {blocks.format('int4')}", q4_1, None),
        ("int4 blocks, int8 block activations (the default from AVX2 up)", q4_1, "blocks"),
        (
            "int8, one scale per row (torch's kernels: GGUF files, --disable-weight-blocks)",
            int8,
            None,
        ),
        (
            "int4, torch's kernels (bfloat16 scale and zero point per 32 inputs)",
            lambda w: quantize_int4(w)[1],
            None,
        ),
        ("w8a8: decoder GEMMs int8 x int8 (activations per token)", int8, "rows"),
        ("checkpoint weights, int8 block activations (--block-activations int8)", same, "blocks"),
    ]
    with torch.inference_mode():
        ref = model(ids).logits[0].float()
        results = []
        for label, quantize, activations in schemes:
            for name, param in model.named_parameters():
                if (
                    name in original
                ):  # every GEMM weight (a tied embedding with the LM head; w8a8 leaves it)
                    head = "embed_tokens" in name or "lm_head" in name
                    param.data = (
                        original[name]
                        if activations == "rows" and head
                        else quantize(original[name])
                    )
            rounding = round_rows_int8 if activations == "rows" else round_blocks_int8
            hooks = [
                m.register_forward_pre_hook(lambda _, args, r=rounding: (r(args[0]),))
                for name, m in model.named_modules()
                if activations
                and isinstance(m, torch.nn.Linear)
                and (activations == "blocks" or "lm_head" not in name)
            ]
            results.append((label, model(ids).logits[0].float()))
            for hook in hooks:
                hook.remove()

        for name, param in model.named_parameters():
            if name in original:
                param.data = original[name]
        results += [
            (label, bfloat16_logits(model, ids, rounding))
            for label, rounding in (
                ("bfloat16 model, blocks x bfloat16 activations (--block-activations float)", None),
                (
                    "bfloat16 model, int8 block activations (the default from AVX2 up)",
                    round_blocks_int8,
                ),
            )
        ]

    log_ref = torch.log_softmax(ref, -1)
    target = ids[0, 1:]
    ppl = lambda lp: torch.nn.functional.nll_loss(lp[:-1], target).exp().item()  # noqa: E731
    print(
        f"{ids.shape[1]} tokens of {len(paths)} file(s); model {os.path.basename(model_dir.rstrip('/'))}"
    )
    print("| weights | top-1 agreement with the checkpoint | mean KL (nats) | perplexity |")
    print("|---|---|---|---|")
    print(f"| checkpoint (float32) | – | – | {ppl(log_ref):.3f} |")
    for label, logits in results:
        log_q = torch.log_softmax(logits, -1)
        agreement = (ref.argmax(-1) == logits.argmax(-1)).float().mean().item()
        kl = (log_ref.exp() * (log_ref - log_q)).sum(-1).mean().item()
        print(f"| {label} | {agreement:.2%} | {kl:.4f} | {ppl(log_q):.3f} |")


def bfloat16_logits(model, ids, rounding) -> torch.Tensor:
    """The model run in bfloat16 as Relay runs a bfloat16 model on GGUF blocks: every linear layer
    multiplies its (bfloat16) input, rounded to 8 bits per block of 32 where `rounding` is given, by
    the checkpoint's exact float32 weights, summing in float32 and rounding the output to bfloat16."""
    exact = {
        m: m.weight.data.float().clone() for m in model.modules() if isinstance(m, torch.nn.Linear)
    }

    def on_exact_weights(m, args, out):
        x = args[0].float()
        return torch.nn.functional.linear(rounding(x) if rounding else x, exact[m]).to(out.dtype)

    model.to(torch.bfloat16)
    hooks = [m.register_forward_hook(on_exact_weights) for m in exact]
    try:
        return model(ids).logits[0].float()
    finally:
        for hook in hooks:
            hook.remove()
        model.to(torch.float32)
        for m, w in exact.items():
            m.weight.data = w


if __name__ == "__main__":
    main()
