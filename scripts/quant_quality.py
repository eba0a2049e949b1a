"""How much does `--quantization int8` change the model? Teacher-forced comparison with transformers.

Runs transformers on a text twice, with the checkpoint's weights and with every GEMM weight replaced
by Relay's int8 quantization of it (`relay.layers.quantize_int8`, dequantized), and reports top-1
agreement of the next-token predictions, the mean KL divergence, and perplexity on the text.

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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relay.layers import quantize_int8
    from relay.model_files import resolve_model_dir

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None)
    p.add_argument("--text", nargs="*", default=None, help="text files (default: README.md and docs/*.md)")
    p.add_argument("--max-tokens", type=int, default=2048)
    args = p.parse_args()

    model_dir = resolve_model_dir(args.model_path)
    paths = args.text or [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
    text = "\n\n".join(open(path).read() for path in paths)
    ids = AutoTokenizer.from_pretrained(model_dir)(text, return_tensors="pt").input_ids[:, :args.max_tokens]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = model(ids).logits[0].float()
        for param in model.parameters():
            if param.dim() == 2:  # every GEMM weight (a tied embedding with the LM head)
                param.data = quantize_int8(param.data)[1]
        quant = model(ids).logits[0].float()

    log_ref, log_quant = torch.log_softmax(ref, -1), torch.log_softmax(quant, -1)
    agreement = (ref.argmax(-1) == quant.argmax(-1)).float().mean().item()
    kl = (log_ref.exp() * (log_ref - log_quant)).sum(-1).mean().item()
    target = ids[0, 1:]
    ppl = [torch.nn.functional.nll_loss(lp[:-1], target).exp().item() for lp in (log_ref, log_quant)]
    print(f"{ids.shape[1]} tokens of {len(paths)} file(s); model {os.path.basename(model_dir.rstrip('/'))}")
    print("| weights | top-1 agreement with the checkpoint | mean KL (nats) | perplexity |")
    print("|---|---|---|---|")
    print(f"| checkpoint (float32) | – | – | {ppl[0]:.3f} |")
    print(f"| int8, one scale per row | {agreement:.2%} | {kl:.4f} | {ppl[1]:.3f} |")


if __name__ == "__main__":
    main()
