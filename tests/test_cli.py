"""The omni-requests command: the demo and the key printer."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from omni_requests import MediaHasher
from omni_requests._cli import main
from omni_requests._demo import run_demo, sample_videos


def test_demo_shows_the_stale_key_with_dicts_and_four_keys_with_records() -> None:
    dict_rows, record_rows = run_demo()
    assert len({r.key for r in dict_rows}) < len(dict_rows)
    assert any(r.key.count("stage0:") == 2 for r in dict_rows), "the write-back stacks prefixes"
    assert any(r.served != r.sent for r in dict_rows), "a replica serves another video's features"
    assert len({r.key for r in record_rows}) == 4
    assert all(r.key.count("stage0:") == 1 and r.served == r.sent for r in record_rows)


def test_demo_command_prints_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "WRONG FEATURES" in out
    assert "4 distinct keys for 4 different videos; requests served another video's features: 0" in out


def test_sample_videos_are_distinct() -> None:
    videos = list(sample_videos().values())
    assert len({v.tobytes() for v in videos}) == len(videos) == 4


def test_key_prints_the_content_key_of_each_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    frames = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)
    np.save(tmp_path / "clip.npy", frames)
    image = Image.new("RGB", (4, 3), (10, 20, 30))
    image.save(tmp_path / "pic.png")
    assert (
        main(
            [
                "key",
                "--model",
                "m",
                "--algorithm",
                "sha256",
                str(tmp_path / "clip.npy"),
                str(tmp_path / "pic.png"),
            ]
        )
        == 0
    )
    hasher = MediaHasher("m", "sha256")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{hasher.key('video', frames)}  {tmp_path / 'clip.npy'}  [array]"
    assert lines[-1] == f"{hasher.key('image', image)}  {tmp_path / 'pic.png'}  [pixels]"
    vllm_media = pytest.importorskip("vllm.multimodal.media")
    from vllm.multimodal.hasher import MultiModalHasher

    # The key vLLM's server assigns when this file arrives in a request: its bytes.
    served = vllm_media.ImageMediaIO().load_bytes((tmp_path / "pic.png").read_bytes())
    server_key = MultiModalHasher.hash_kwargs("sha256", model_id="m", image=served)
    assert lines[1] == f"{server_key}  {tmp_path / 'pic.png'}  [server]"
    assert server_key != hasher.key("image", image)


def test_pixels_is_the_key_of_the_image_as_vllms_parser_hands_it_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # docs/guide.md: [pixels] is the record's key of the decoded image: turned upright by
    # its EXIF orientation and flattened to RGB, as vLLM's parser does before hashing.
    pixels = np.random.default_rng(3).integers(0, 256, (6, 5, 4), dtype=np.uint8)
    Image.fromarray(pixels, "RGBA").save(tmp_path / "clear.png")
    turned = Image.fromarray(pixels[..., :3])
    exif = turned.getexif()
    exif[0x0112] = 6
    turned.save(tmp_path / "turned.jpg", exif=exif.tobytes(), quality=95)
    files = [tmp_path / "clear.png", tmp_path / "turned.jpg"]
    assert main(["key", "--model", "m", *map(str, files)]) == 0
    printed = {
        line.split("  ")[1]: line.split("  ")[0]
        for line in capsys.readouterr().out.splitlines()
        if line.endswith("[pixels]")
    }
    hasher = MediaHasher("m")
    for path in files:
        decoded = Image.open(path)
        decoded.load()
        assert printed[str(path)] == hasher.content_key("image", decoded) != hasher.key("image", decoded)
        vllm_image = pytest.importorskip("vllm.multimodal.image")
        from vllm.multimodal.hasher import MultiModalHasher

        parsed = vllm_image.convert_image_mode(vllm_image.normalize_image(decoded), "RGB")
        assert printed[str(path)] == MultiModalHasher.hash_kwargs("blake3", model_id="m", image=parsed)


def test_key_reads_stdin_validates_modality_and_has_a_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    frames = np.zeros((2, 4, 4, 3), np.uint8)
    buffer = io.BytesIO()
    np.save(buffer, frames)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(buffer.getvalue())))
    assert main(["key", "--model", "m", "-"]) == 0
    assert capsys.readouterr().out == f"{MediaHasher('m').key('video', frames)}  -  [array]\n"
    with pytest.raises(SystemExit) as exit_:
        main(["key", "--model", "m", "--modality", "bogus", "x.png"])
    assert exit_.value.code == 2
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("omni-requests ")


def test_key_never_prints_a_traceback_for_bad_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    os.mkfifo(tmp_path / "fifo.png")
    Image.new("1", (20_000, 20_000)).save(tmp_path / "bomb.png")
    from numpy.lib import format as npy

    with open(tmp_path / "huge.npy", "wb") as file:
        npy.write_array_header_1_0(file, {"descr": "<f4", "fortran_order": False, "shape": (1 << 40,)})
    (tmp_path / "junk.png").write_bytes(b"not an image")
    names = [str(tmp_path / n) for n in ("fifo.png", "bomb.png", "huge.npy", "junk.png", "missing.png")]
    assert main(["key", "--model", "m", *names]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "Traceback" not in captured.err
    lines = captured.err.splitlines()
    assert len(lines) == len(names)
    assert all(line.startswith(f"omni-requests: {n}: ") for line, n in zip(lines, names, strict=True))
    assert "not a regular file" in captured.err and "more than its bytes hold" in captured.err


def test_key_reports_bad_files_and_keeps_going(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "odd.npy", np.zeros((2, 2), np.uint8))
    np.save(tmp_path / "ok.npy", np.zeros(4, np.float32))
    status = main(
        [
            "key",
            "--model",
            "m",
            str(tmp_path / "missing.png"),
            str(tmp_path / "odd.npy"),
            str(tmp_path / "ok.npy"),
        ]
    )
    captured = capsys.readouterr()
    assert status == 1
    assert "missing.png" in captured.err and "pass --modality" in captured.err
    assert captured.out.endswith(f"  {tmp_path / 'ok.npy'}  [array]\n")


def test_module_entry_point_runs() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "omni_requests", "demo"], capture_output=True, text=True, check=True
    )
    assert "omni-requests records" in result.stdout
