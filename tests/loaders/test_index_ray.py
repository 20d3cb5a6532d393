"""``omniscale data index --ray``: the per-shard work as a Ray Data pipeline on a local Ray
instance writes the same index file, byte for byte, as the local run; a worker's one-line
error stays one line."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from omniscale.errors import UserError
from omniscale.loaders.index import index_paths
from omniscale.tools.cli import build_parser
from tests.loaders.index_fixtures import (
    audio_bytes,
    caption_members,
    image_bytes,
    video_bytes,
    write_tar,
    write_tokenizer,
)

# The suite runs on two xdist workers; Ray tests share one of them (`--dist loadgroup`), so
# that no two Ray clusters start at once on two cores.
pytestmark = pytest.mark.xdist_group("ray")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_pipeline_writes_the_local_runs_bytes(local_ray, tmp_path):
    tokenizer = write_tokenizer(tmp_path / "tokenizer.json")
    source = tmp_path / "mix"
    for i in range(3):
        write_tar(source / f"mix-{i:03d}.tar",
                  caption_members(f"i{i}", "<image> a cat", jpg=image_bytes(40 + i, 32))
                  + caption_members(f"v{i}", "a clip", mp4=video_bytes(3 + i, 4, 32, 32))
                  + caption_members(f"a{i}", "speech", wav=audio_bytes(0.3, 16000))
                  # a parser's message that once quoted an object's address
                  + caption_members(f"bad{i}", "noise", wav=b"RIFF....WAVEjunk" * 4))
    local, = index_paths([source], tokenizer=tokenizer, workers=1, progress=False)
    expected = (source / "_index.parquet").read_bytes()
    on_ray, = index_paths([source], tokenizer=tokenizer, force=True, ray=True, progress=False)
    assert (source / "_index.parquet").read_bytes() == expected
    assert (on_ray.shards_indexed, on_ray.samples, on_ray.errors) == \
        (3, local.samples, local.errors)
    assert local.corrupt == 3 and "object at 0x" not in " ".join(local.errors)

    no_text = tmp_path / "notext"
    no_text.mkdir()
    pq.write_table(pa.table({"body": ["x"]}), no_text / "a.parquet")
    with pytest.raises(UserError, match=r"^\S*notext/a.parquet: no 'text' column; a Parquet "
                                        r"source needs a string column 'text'$"):
        index_paths([no_text], tokenizer=tokenizer, ray=True, progress=False)


def test_cli_ray_flag():
    parse = build_parser().parse_args
    assert parse(["data", "index", "src", "--ray"]).ray is True
    assert parse(["data", "index", "src", "--ray", "auto"]).ray == "auto"
    assert parse(["data", "index", "src"]).ray is None
