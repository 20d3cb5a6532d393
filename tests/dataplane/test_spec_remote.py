"""Remote sources in a spec: URL paths, storage options without credentials, ``index_dir``;
and the catalog's snapshot of a remote source's index location."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from omniscale.dataplane.spec import SpecError, load_spec
from omniscale.location import Location, is_url
from tests.dataplane.test_spec import BASE, write

REMOTE = {"name": "web", "path": "s3://corpus/web/", "format": "webdataset",
          "template": "image_caption",
          "storage_options": {"endpoint_url": "http://127.0.0.1:9000",
                              "client_kwargs": {"region_name": "eu-west-1"}}}


def with_remote(**changes) -> dict:
    data = copy.deepcopy(BASE)
    data["sources"].append({**REMOTE, **changes})
    data["schedule"]["segments"][0]["weights"]["web"] = 1
    return data


def test_url_path_keeps_its_options_and_index_defaults_beside_it(root):
    spec = load_spec(write(root, with_remote()))
    web = spec.sources[-1]
    assert web.path == "s3://corpus/web"  # not resolved against the spec's directory
    assert web.location == Location("s3://corpus/web", json.dumps(
        REMOTE["storage_options"], sort_keys=True, separators=(",", ":")))
    assert web.location.storage_options == REMOTE["storage_options"]
    assert web.index == web.location
    assert spec.locations["text"] == Location.of(root / "train" / "text")


def test_index_dir_holds_every_sources_index_by_name(root):
    data = with_remote()
    data["index_dir"] = "idx"
    spec = load_spec(write(root, data))
    assert spec.indexes["web"].url == str(root / "idx" / "web")
    assert spec.indexes["text"].url == str(root / "idx" / "text")
    data["index_dir"] = "s3://other/indexes"
    spec = load_spec(write(root, data))
    assert spec.indexes["web"].url == "s3://other/indexes/web"
    assert spec.indexes["web"].storage_options == REMOTE["storage_options"]


@pytest.mark.parametrize("options, field", [
    ({"key": "AKIA"}, "storage_options.key"),
    ({"secret": "x"}, "storage_options.secret"),
    ({"client_kwargs": {"aws_secret_access_key": "x"}},
     "storage_options.client_kwargs.aws_secret_access_key"),
    ({"token": "x"}, "storage_options.token"),
])
def test_credentials_in_a_spec_are_refused_in_one_line(root, options, field):
    with pytest.raises(SpecError) as e:
        load_spec(write(root, with_remote(storage_options=options)))
    message = str(e.value)
    assert "\n" not in message and f"sources[2].{field}" in message
    assert "environment" in message
    assert "AKIA" not in message


def test_storage_options_on_a_local_path_are_refused(root):
    data = copy.deepcopy(BASE)
    data["sources"][0]["storage_options"] = {"anon": True}
    with pytest.raises(SpecError, match=r"sources\[0\].storage_options: only for a URL"):
        load_spec(write(root, data))


def test_file_urls_are_local_paths(root):
    data = copy.deepcopy(BASE)
    data["sources"][0]["path"] = f"file://{root}/train/text"
    spec = load_spec(write(root, data))
    assert spec.sources[0].path == root / "train" / "text"
    assert not is_url("file:///x") and is_url("s3://b/x") and is_url("gs://b")
    assert not is_url("C:/data") and not is_url("relative/path")


def test_shown_drops_user_info():
    loc = Location.of("https://user:hunter2@example.com/data")
    assert loc.shown() == "https://example.com/data" and "hunter2" not in str(loc)


def test_catalog_snapshot_keeps_a_remote_index_location(tmp_path):
    """The plane's snapshot names the index location with its options and restores it."""
    from omniscale.dataplane.catalog import Catalog, _location, _where

    loc = Location.of("s3://corpus/web", {"endpoint_url": "http://127.0.0.1:9000"})
    entry = {"name": "web", **_where(loc)}
    assert entry["path"] == "s3://corpus/web"
    assert _location(json.loads(json.dumps(entry))) == loc
    local = Location.of(tmp_path)
    assert _where(local) == {"path": str(tmp_path)}  # old snapshots' shape, unchanged
    assert _location({"path": str(tmp_path)}) == local
    assert Catalog(0).state_dict()["sources"] == []


def test_spec_example_in_docs_parses(root):
    """The object-store source of docs/mixing-spec.md is a valid source entry."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "mixing-spec.md").read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    web = next(s for s in yaml.safe_load(block)["sources"] if s["name"] == "web_images")
    spec = load_spec(write(root, with_remote(**{k: web[k] for k in
                                                ("path", "storage_options")})))
    assert spec.sources[-1].location.url == web["path"]
