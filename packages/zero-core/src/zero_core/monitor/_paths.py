"""Where file-writing monitors put their output."""

from __future__ import annotations

import os


def job_dir(output_path: str, job_name: str, owner: str) -> str:
    """``<output_path>/<job_name>``, with the launch directory as the default output path; created."""
    if not job_name or os.sep in job_name or job_name in (".", ".."):
        raise ValueError(f"{owner}: 'job_name' must be a plain directory name, got {job_name!r}")
    path = os.path.join(output_path or os.getcwd(), job_name)
    os.makedirs(path, exist_ok=True)
    return path
