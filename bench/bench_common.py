"""What the training benchmarks under bench/ share: where a run happened, and its JSON."""
import datetime
import json
import platform


def write_result(result, path):
    """Stamps result with the date, host, torch version and GPU (when it ran on
    one), then writes it to path as JSON when path is given."""
    import torch

    result.update(date=datetime.date.today().isoformat(), host=platform.node(), torch=torch.__version__)
    if result.get("device", "").startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name()
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2, default=str)
