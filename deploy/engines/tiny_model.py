"""Build a tiny Llama model and a LoRA adapter for it, locally and deterministically.

Runs in the engines' venv (torch, tokenizers, safetensors; no hub): two layers, hidden size 256,
random bfloat16 weights from a fixed seed, a byte-level BPE trained on text this script writes, a
chat template. The same arguments give byte-identical files. Usage::

    python tiny_model.py OUT_DIR            # writes OUT_DIR/model and OUT_DIR/lora
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SEED = 1234
VOCAB = 2048
HIDDEN = 256
INTERMEDIATE = 512
LAYERS = 2
HEADS = 4
MAX_POSITIONS = 8192
LORA_RANK = 8
SPECIAL = ["<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_WORDS = (
    "the a an of to in is it that for on with as was by be this are from at or have not but they "
    "which one you all were her she there would their we him been has when who will more no if out "
    "so said what up its about into than them can only other new some could time these two may then "
    "do first any my now such like our over man me even most made after also did many before must "
    "through back years where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between both life being "
    "under never day same another know while last might us great old year off come since against go "
    "came right used take three system prompt request route engine cache block token model server "
    "user assistant answer question please explain write code python function list value key"
).split()


def corpus(lines: int = 4000) -> str:
    """Deterministic text for the BPE: sentences of common words, numbers and punctuation."""
    rng = random.Random(SEED)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        sentence = " ".join(words)
        out.append(sentence[0].upper() + sentence[1:] + rng.choice([".", "?", "!", ",", ":"]))
    return "\n".join(out) + "\n"


def build_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus().splitlines(), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
        "model_max_length": MAX_POSITIONS,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    _dump(out / "tokenizer_config.json", config)
    _dump(out / "special_tokens_map.json", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    return tok.get_vocab_size()


def build_weights(out: Path, vocab: int) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(SEED)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(vocab, HIDDEN), "lm_head.weight": rand(vocab, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[p + f"self_attn.{name}.weight"] = rand(HIDDEN, HIDDEN)
        tensors[p + "mlp.gate_proj.weight"] = rand(INTERMEDIATE, HIDDEN)
        tensors[p + "mlp.up_proj.weight"] = rand(INTERMEDIATE, HIDDEN)
        tensors[p + "mlp.down_proj.weight"] = rand(HIDDEN, INTERMEDIATE)
        tensors[p + "input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    tensors["model.norm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "head_dim": HIDDEN // HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    }
    _dump(out / "config.json", config)
    _dump(out / "generation_config.json", {"bos_token_id": 0, "eos_token_id": 1})


def build_lora(out: Path, base: Path) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(SEED + 1)
    tensors = {}
    for i in range(LAYERS):
        for name in ("q_proj", "v_proj"):
            key = f"base_model.model.model.layers.{i}.self_attn.{name}"
            tensors[key + ".lora_A.weight"] = (torch.randn(LORA_RANK, HIDDEN, generator=gen) * 0.02).to(
                torch.bfloat16
            )
            tensors[key + ".lora_B.weight"] = (torch.randn(HIDDEN, LORA_RANK, generator=gen) * 0.02).to(
                torch.bfloat16
            )
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base.name,
        "r": LORA_RANK,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["q_proj", "v_proj"],
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    _dump(out / "adapter_config.json", config)


def _dump(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    root = Path(argv[0])
    model, lora = root / "model", root / "lora"
    model.mkdir(parents=True, exist_ok=True)
    lora.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(model)
    build_weights(model, vocab)
    build_lora(lora, model)
    print(f"tiny model: {model} (vocab {vocab}, {LAYERS} layers, hidden {HIDDEN}); LoRA adapter: {lora}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
