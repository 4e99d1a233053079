"""Tiny random checkpoints of every family, saved with ``save_pretrained``.

Each has a small window that the block size used in tests does not divide (w=6, b=4), and
a byte-level BPE tokenizer trained here on a few lines of mixed-script text, so multi-byte
characters span several tokens (what incremental detokenization must get right). It also
carries a chat template, for the chat endpoints.
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

W, B = 6, 4
VOCAB = 320
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "Once upon a time, there was a little girl named Lily.",
    "The ring buffer overwrites the oldest token in the window.",
    "Café, naïve, résumé: accents are two bytes in UTF-8.",
    "漢字とかなは三バイト。中文也是。",
    "Emoji take four bytes: 🚀🌍🎉 and so on.",
    "def f(x):\n    return x * 2  # code, too",
]

COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=None, pad_token_id=None,
)

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(num_hidden_layers=2, rope_scaling={"rope_type": "linear",
                                                                       "factor": 2.0})),
    "mistral": ("MistralConfig", dict(num_hidden_layers=3, sliding_window=W)),
    # YaRN: the tests' 6w tokens run past the 16 positions it was "trained" for
    "llama_yarn": ("LlamaConfig", dict(num_hidden_layers=2, max_position_embeddings=64,
                                       initializer_range=0.15,  # scores big enough to feel it
                                       rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 16,
                                                        "rope_theta": 10000.0})),
    # Llama 3's rotary scaling (EXAONE 4 uses it too): the tests' 6w tokens run past the
    # 64 positions it was "trained" for, and the pairs it blends turn 1-4 times in them
    "llama3_rope": ("LlamaConfig", dict(
        num_hidden_layers=2, max_position_embeddings=256, initializer_range=0.15,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                         "rope_theta": 10000.0})),
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=3, use_sliding_window=True,
                                  sliding_window=W, max_window_layers=1)),
    "phi3": ("Phi3Config", dict(num_hidden_layers=2, sliding_window=W, pad_token_id=0)),
    "gemma3_text": ("Gemma3TextConfig", dict(
        num_hidden_layers=4, sliding_window=W, head_dim=16, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
        tie_word_embeddings=True, final_logit_softcapping=30.0)),
    # NOTE: soft-caps small enough to bend these random weights' scores and logits, so a
    # model that ignored them would fail the comparisons
    "gemma2": ("Gemma2Config", dict(
        num_hidden_layers=4, sliding_window=W, head_dim=16, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "full_attention"],
        tie_word_embeddings=True, attn_logit_softcapping=0.2, final_logit_softcapping=1.0)),
    # q/k norms over the whole projections, post-norm blocks, a rotary base per layer type
    "olmo3": ("Olmo3Config", dict(
        num_hidden_layers=4, sliding_window=W,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention",
                     "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 5e5}})),
    # per-head q/k norms, post-norm blocks, no rotary on the full layers
    "exaone4": ("Exaone4Config", dict(
        num_hidden_layers=4, sliding_window=W, sliding_window_pattern=4,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention",
                     "full_attention"])),
    # sinks in every attention, a top-2-of-4 mixture of experts with the clamped SwiGLU,
    # YaRN, biased q/k/v/o, sliding and full layers alternating
    "gpt_oss": ("GptOssConfig", dict(
        num_hidden_layers=4, sliding_window=W, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, initializer_range=0.3, swiglu_limit=1.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "full_attention"], max_position_embeddings=64,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 16, "rope_theta": 10000.0})),
    # LayerNorm, attention and MLP side by side on one norm, interleaved rotary on the
    # sliding layers only, logits scaled
    # full layers of their own head size and KV heads whose values are the keys'
    # projection, proportional rotary there, the last two layers attending to the K/V of the
    # last earlier layer of their kind (with twice the MLP), per-layer input embeddings
    "gemma4_text": ("Gemma4TextConfig", dict(
        num_hidden_layers=6, sliding_window=W, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=2, attention_k_eq_v=True, num_kv_shared_layers=2,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
        use_double_wide_mlp=True, tie_word_embeddings=True, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "proportional",
                                            "partial_rotary_factor": 0.5,
                                            "rope_theta": 1e6}})),
    # Gemma 4 26B-A4B's layout: a top-2-of-4 mixture of experts beside each dense MLP
    "gemma4_moe": ("Gemma4TextConfig", dict(
        num_hidden_layers=4, sliding_window=W, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=48,
        tie_word_embeddings=True, final_logit_softcapping=30.0, initializer_range=0.1,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "full_attention"])),
    "cohere2": ("Cohere2Config", dict(
        num_hidden_layers=4, sliding_window=W, logit_scale=4.0, tie_word_embeddings=True,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention",
                     "full_attention"])),
}


def byte_bpe_tokenizer(chat_template: bool = True) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of `VOCAB` ids (256 bytes + merges + 3 specials)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<pad>", "<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def make_checkpoint(family: str, root: pathlib.Path, *, eos: bool = False,
                    chat_template: bool = True,
                    overrides: dict[str, Any] | None = None) -> pathlib.Path:
    """Save a random ``family`` model and the tokenizer under ``root / family``.

    Args:
        eos: give the model an end-of-sequence id (the tokenizer's ``<eos>``); by default
            none, so greedy runs never stop early.
        chat_template: give the tokenizer a chat template.
        overrides: config fields that replace the family's own (the folder is then named
            ``<family>-custom``).
    """
    class_name, extra = FAMILIES[family]
    tokenizer = byte_bpe_tokenizer(chat_template)
    eos_id = tokenizer.eos_token_id if eos else None
    fields = {**COMMON, **extra, "eos_token_id": eos_id, **(overrides or {})}
    cfg = getattr(transformers, class_name)(**fields)
    torch.manual_seed(sum(map(ord, family)))
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # random biases and norm weights, so they matter in the check
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or name.endswith("scale"):
                p.normal_(1.0 if name.endswith("scale") else 0.0,
                          0.3 if "norm" in name or name.endswith("scale") else 0.1)
        for name, buf in model.named_buffers():  # Gemma 4's per-layer output scale
            if name.endswith("layer_scalar"):
                buf.uniform_(0.5, 1.5)
    model.generation_config.eos_token_id = eos_id
    path = root / (family + ("-eos" if eos else "") + ("-custom" if overrides else ""))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def hf_reference(path: pathlib.Path) -> Any:
    """transformers' own model for the folder, float32, eager attention."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def random_tokens(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def make_llm(path: pathlib.Path, **kwargs: Any) -> Any:
    """An `engine.LLM` on a tiny checkpoint: float32, b = `B`, 8 tokens a step (prompts
    come in several chunks), every ring read checked (``debug_kv``)."""
    from ringserve.engine import LLM

    options: dict[str, Any] = dict(dtype="float32", block_size=B, kv_cache_memory="4MiB",
                                   max_num_seqs=8, max_num_batched_tokens=8, debug_kv=True,
                                   max_model_len=256)
    return LLM(str(path), **{**options, **kwargs})
