"""The Hub tests' client, run in a fresh interpreter (so HF_ENDPOINT / HF_HUB_OFFLINE / HF_HOME take effect before
huggingface_hub is imported): argv[1] is a JSON list of actions; prints one JSON result per action."""

import json, os, sys
from pathlib import Path

def files_under(root):
    root = Path(root)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() or p.is_symlink())

def run(action):
    kind = action["kind"]
    try:
        if kind == "load":
            from optimum_qnn.runtime.modeling import QNNModelForCausalLM
            model = QNNModelForCausalLM.from_pretrained(action["repo"], soc=action.get("soc"), revision=action.get("revision"))
            out = model.generate(action["prompt"], max_new_tokens=4).reshape(-1).tolist()
            return {"root": str(model.root), "files": files_under(model.root), "tokens": out,
                    "soc": model.manifest.target.soc, "name": model.name}
        if kind == "snapshot":
            from huggingface_hub import snapshot_download
            root = snapshot_download(action["repo"], revision=action["revision"])
            return {"root": root, "files": files_under(root)}
        if kind == "refs":
            from huggingface_hub import HfApi
            info = HfApi().model_info(action["repo"], revision=action["revision"])
            return {"sha": info.sha}
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e)}
    raise ValueError(kind)

for action in json.loads(sys.argv[1]):
    print("RESULT " + json.dumps(run(action)), flush=True)
