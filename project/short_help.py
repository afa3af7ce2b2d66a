"""`python -m project fit --help`: the keys people change, first and short; `--help-all` is LightningCLI's full help.

LightningCLI's help lists every argument of every class in the config, Trainer flags first (several hundred
lines, after the imports of the whole training stack). This one reads the defaults from configs/default.yaml and
each key's description from the constructor docstrings of the classes that config names (the `Args:` sections,
read with `ast` from the source files, nothing imported), so it cannot drift from the code, and it prints in
about the time Python and PyYAML take to start.
"""

import ast
import shutil
import sys
import textwrap
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "configs" / "default.yaml"
# (key on the command line, where its description is: (source file, class) or a text of its own)
KEYS: list[tuple[str, tuple[str, str] | str]] = [
    (
        "--config",
        "a YAML file over configs/default.yaml (repeatable: configs/ddp.yaml, configs/debug/*.yaml, ...)",
    ),
    ("--data.init_args.source", ("project/data/datamodule.py", "ImageClassificationDataModule")),
    ("--data.init_args.root", ("project/data/datamodule.py", "ImageClassificationDataModule")),
    ("--data.init_args.image_size", ("project/data/datamodule.py", "ImageClassificationDataModule")),
    ("--data.init_args.batch_size", ("project/data/datamodule.py", "ImageClassificationDataModule")),
    ("--data.init_args.augment", ("project/data/datamodule.py", "ImageClassificationDataModule")),
    ("--data.init_args.num_workers", ("project/data/datamodule.py", "ImageClassificationDataModule")),
    ("--data.init_args.split_seed", ("project/data/datamodule.py", "ImageClassificationDataModule")),
    ("--model.init_args.model", ("project/module.py", "ClassificationModule")),
    (
        "--model.init_args.optimizer.init_args.lr",
        "the peak learning rate of the optimizer (AdamW by default)",
    ),
    ("--model.init_args.optimizer", ("project/module.py", "ClassificationModule")),
    ("--model.init_args.scheduler", ("project/module.py", "ClassificationModule")),
    ("--model.init_args.label_smoothing", ("project/module.py", "ClassificationModule")),
    ("--trainer.max_epochs", "epochs to train"),
    (
        "--trainer.devices",
        "devices per node: auto (every GPU, else 1 CPU process), a count, or a list of ids",
    ),
    ("--trainer.precision", "32-true, bf16-mixed, 16-mixed; unset: chosen for the hardware"),
    ("--seed_everything", "the run's seed: weights, data order, augmentation"),
    (
        "--ckpt_path",
        "resume from a checkpoint: `last` (the newest run's) or a path; the run's own config is used",
    ),
    ("--run_dir", "where the run writes; default runs/<time>, or the run of --ckpt_path"),
    ("--checkpoint_every_n_steps", "also write checkpoints/last.ckpt every N optimizer steps (0 = off)"),
    ("--monitor", "the metric that selects best-*.ckpt (default val/loss); --mode max if higher is better"),
]


def _args_section(path: Path, class_name: str) -> dict[str, str]:
    """{argument: first sentence of its description} from the class docstring's `Args:` section."""
    tree = ast.parse(path.read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
    doc = ast.get_docstring(node) or ""
    found: dict[str, str] = {}
    current, in_args = None, False
    for line in doc.splitlines():
        if line.strip() == "Args:":
            in_args = True
            continue
        if not in_args:
            continue
        if line and not line.startswith(" "):  # the next section
            break
        stripped = line.strip()
        if line.startswith("    ") and not line.startswith("        ") and ":" in stripped:
            current, text = stripped.split(":", 1)
            found[current] = text.strip()
        elif current and stripped:
            found[current] += " " + stripped
    return {k: v.split(". ")[0].rstrip(".") for k, v in found.items()}


def _default(config: dict, key: str) -> str:
    """The value configs/default.yaml gives a dotted key (init_args followed), or '' when it sets none."""
    node = config
    for part in key.lstrip("-").split("."):
        if not isinstance(node, dict) or part not in node:
            return ""
        node = node[part]
    if isinstance(node, dict):
        return str(node.get("class_path", ""))
    return str(node)


def short_help() -> str:
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    docs: dict[tuple[str, str], dict[str, str]] = {}
    rows = []
    for key, where in KEYS:
        if isinstance(where, tuple):
            if where not in docs:
                docs[where] = _args_section(ROOT / where[0], where[1])
            text = docs[where].get(key.rsplit(".", 1)[-1], "")
        else:
            text = where
        default = _default(config, key)
        rows.append((key, f"{text}{f' (default: {default})' if default else ''}"))
    width = max(len(k) for k, _ in rows) + 2
    columns = max(80, min(shutil.get_terminal_size((110, 24)).columns, 140))
    wrap = textwrap.TextWrapper(width=columns, initial_indent="  ", subsequent_indent=" " * (width + 2))
    lines = [
        'usage: python -m project fit [--config FILE ...] [--KEY VALUE ...]   (make train ARGS="--KEY VALUE ...")',
        "",
        "Train configs/default.yaml, then test the best checkpoint. The keys most runs change:",
        "",
        *(wrap.fill(f"{k.ljust(width)}{v}") for k, v in rows),
        "",
        "Every key of every class in the config (the Trainer's included): python -m project fit --help-all",
        "One class's keys: python -m project fit --model.init_args.model.help project.models.ConvNet",
    ]
    return "\n".join(lines)


def main() -> None:
    print(short_help())


if __name__ == "__main__":
    sys.exit(main())
