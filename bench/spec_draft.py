"""A draft model for speculative decoding made from the target itself: its first N layers.

No smaller model with SmolLM2's vocabulary ships offline, so the draft-model benchmark (and
the tests) use a layer-truncated copy of the target: the same embeddings, tokenizer, final
norm and LM head, and only the first `num_layers` decoder layers. Untrained for the role,
it agrees with the target less than a distilled draft would: a lower bound for the method.

    python bench/spec_draft.py SRC_DIR DST_DIR --layers 4
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_WEIGHTS = ("*.safetensors", "model.safetensors.index.json")


def write_truncated_copy(src: str | Path, dst: str | Path, num_layers: int) -> Path:
    """Copies the HF checkpoint at `src` into `dst` with only its first `num_layers`
    decoder layers (config.json's num_hidden_layers changed to match); returns `dst`."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    if not 1 <= num_layers < config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in [1, {config['num_hidden_layers']})")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not any(f.match(p) for p in _WEIGHTS):
            shutil.copy2(f, dst / f.name)
    tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        for name, t in load_file(str(shard)).items():
            m = _LAYER.match(name)
            if m is None or int(m.group(1)) < num_layers:
                tensors[name] = t.contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    for key in ("layer_types", "max_window_layers"):
        if isinstance(config.get(key), list):
            config[key] = config[key][:num_layers]
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    print(write_truncated_copy(args.src, args.dst, args.layers))


if __name__ == "__main__":
    main()
