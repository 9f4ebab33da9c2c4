"""Train a (tiny, randomly initialised) Hugging Face Mixtral with the moeblaze backend.

    python examples/hf_mixtral_train.py            # CPU or GPU
    python examples/hf_mixtral_train.py --bf16     # bfloat16 (GPU)

Nothing in the model changes: torch.compile finds each MoE layer, proves it equal to the MoEBlaze
operator and swaps it in. transformers >= 5 runs its experts through `grouped_mm` by default for
whole models; it is set explicitly here so the example does not depend on that default.
"""
import argparse
import logging

import torch
import transformers

import moeblaze_fx

parser = argparse.ArgumentParser()
parser.add_argument("--bf16", action="store_true")
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--checkpoint", default="activations", choices=["activations", "recompute", "auto"])
args = parser.parse_args()

logging.basicConfig(format="%(message)s")
logging.getLogger("moeblaze_fx").setLevel(logging.INFO)  # prints the compile report
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if args.bf16 else torch.float32

config = transformers.MixtralConfig(
    vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
)
torch.manual_seed(0)
model = transformers.MixtralForCausalLM(config).to(device, dtype)
model.set_experts_implementation("grouped_mm")
compiled = torch.compile(model, backend="moeblaze", fullgraph=True, options={"checkpoint": args.checkpoint})
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

for step in range(args.steps):
    tokens = torch.randint(0, config.vocab_size, (4, 128), device=device)
    loss = compiled(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"step {step}: loss {loss.item():.4f}")

print(f"{sum(r.status == 'rewritten' for r in moeblaze_fx.last_report())} MoE layers run as MoEBlaze operators")
