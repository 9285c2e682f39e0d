"""Make the tiny models the real-vLLM tests serve, from the shared books; nothing is downloaded.

Run with the vLLM virtualenv's Python (it has torch, transformers, tokenizers and safetensors; the
gateway's `.venv` has none of them): `VENV/bin/python tests/vllm_engine/make_models.py OUT_DIR`.
`tests/vllm_engine/engine.py` `models_dir()` calls it once per machine and caches `OUT_DIR` under a key
of this file's text and the books' bytes.

Writes, under OUT_DIR:
- `dense/`: a Qwen2ForCausalLM (2 layers, hidden 256, 4 query and 2 KV heads of 64, vocab 4,096), its
  byte-level BPE tokenizer trained on the books, a ChatML chat template, and `generation_config.json`
  with `<|im_end|>` as end of sequence. Trained for `TRAIN_STEPS` steps on the books so that its
  greedy text is words that tokenize back to the tokens they came from (a random-weight model's
  byte soup often does not, and a migrated stream's exactness is checked through that round trip).
- `moe/`: a Qwen2MoeForCausalLM (2 layers, 4 experts, top 2, a shared expert) on the same tokenizer,
  random weights: vLLM's fused-MoE path on the CPU.
- `lora/`: a rank-8 PEFT LoRA adapter of `dense/` on `q_proj` and `v_proj` (non-zero, so the
  adapter's greedy text differs from the base model's).

Deterministic for given books (fixed seeds, one thread). Prints the output directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

VOCAB = 4096
CONTEXT = 4096
TRAIN_STEPS = 300
TRAIN_BATCH = 16
TRAIN_SEQ = 128
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def books(shared: Path) -> str:
    """The three novels' text, each cut to its first 600,000 characters (enough for a 4K vocabulary)."""
    texts = [p.read_text(encoding="utf-8")[:600_000] for p in sorted((shared / "text" / "books").glob("*.txt"))]
    if not texts:
        raise SystemExit(f"make_models: no books under {shared / 'text' / 'books'}")
    return "\n\n".join(texts)


def tokenizer(text: str, out: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2's pre-tokenizer) trained on `text`, saved in `out`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text[i:i + 10_000] for i in range(0, len(text), 10_000)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=CONTEXT)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def dense_config(tok: PreTrainedTokenizerFast) -> Qwen2Config:
    return Qwen2Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       max_position_embeddings=CONTEXT, tie_word_embeddings=True,
                       bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                       pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), torch_dtype="float32")


def generation_config(tok: PreTrainedTokenizerFast, out: Path) -> None:
    ids = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))


def train(model: Qwen2ForCausalLM, ids: torch.Tensor) -> float:
    """`TRAIN_STEPS` AdamW steps of next-token loss on random windows of `ids`; the last loss."""
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(TRAIN_STEPS):
        starts = torch.randint(0, ids.numel() - TRAIN_SEQ - 1, (TRAIN_BATCH,), generator=gen)
        batch = torch.stack([ids[s:s + TRAIN_SEQ] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss)


def lora(model: Qwen2ForCausalLM, out: Path) -> None:
    """A PEFT-format adapter (adapter_config.json + adapter_model.safetensors), rank 8, alpha 16."""
    gen = torch.Generator().manual_seed(1)
    cfg = model.config
    rank = 8
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for proj, width in (("q_proj", cfg.num_attention_heads * cfg.head_dim),
                            ("v_proj", cfg.num_key_value_heads * cfg.head_dim)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, cfg.hidden_size, generator=gen) * 0.2
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(width, rank, generator=gen) * 0.2
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 16, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"], "bias": "none", "fan_in_fan_out": False,
        "base_model_name_or_path": None, "modules_to_save": None}))


def main(out: Path, shared: Path) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    text = books(shared)
    dense_dir, moe_dir = out / "dense", out / "moe"
    tok = tokenizer(text, dense_dir)
    ids = torch.tensor(tok(text[:400_000])["input_ids"], dtype=torch.long)
    dense = Qwen2ForCausalLM(dense_config(tok))
    loss = train(dense, ids)
    dense.save_pretrained(dense_dir, safe_serialization=True)
    generation_config(tok, dense_dir)
    moe = Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=CONTEXT, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=128, shared_expert_intermediate_size=256, tie_word_embeddings=True,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), torch_dtype="float32"))
    moe.save_pretrained(moe_dir, safe_serialization=True)
    tok.save_pretrained(moe_dir)
    generation_config(tok, moe_dir)
    lora(dense, out / "lora")
    (out / "made.json").write_text(json.dumps({"train_steps": TRAIN_STEPS, "final_loss": loss}))
    print(out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: make_models.py OUT_DIR SHARED_DATA_DIR")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
