"""Hugging Face transformers on the same weights and GPU as `tapedeck bench engine --device cuda`:
batch-1 prefill and greedy decode of a model directory, bf16, eager attention, CUDA events.

    python3 bench/cuda/hf_decode.py DIR [PROMPT_LEN] [GEN]
"""
import sys
import time

import torch
from transformers import AutoModelForCausalLM

d = sys.argv[1]
prompt_len = int(sys.argv[2]) if len(sys.argv) > 2 else 512
gen = int(sys.argv[3]) if len(sys.argv) > 3 else 64
model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
vocab = 8192  # token IDs the tokenizer knows (the padded rows are never fed)
ids = torch.randint(0, vocab, (1, prompt_len), device="cuda")
with torch.no_grad():
    for _ in range(2):  # warm-up
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(3):
        model(ids)
    torch.cuda.synchronize()
    prefill = (time.perf_counter() - t) / 3
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=gen, min_new_tokens=gen, do_sample=False)
    torch.cuda.synchronize()
    total = time.perf_counter() - t
decode = (gen - 1) / max(total - prefill, 1e-9)
print(
    f"transformers {__import__('transformers').__version__} torch {torch.__version__} on "
    f"{torch.cuda.get_device_name()}: prefill {prompt_len / prefill:.0f} tokens/s "
    f"({prompt_len} tokens), decode {decode:.1f} tokens/s ({gen} tokens), bf16 eager"
)
