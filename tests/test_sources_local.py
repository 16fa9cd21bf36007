"""Checks of sources that need no S3 endpoint: source URIs, the S3 params, local sources."""
import pytest

from longlive_core.config import ConfigError, from_mapping
from longlive_core.data.ingest import IngestConfig
from longlive_core.data.roots import SourceError
from longlive_core.data.s3_mirror import S3Config, S3Source, folder_clashes
from longlive_core.data.sources import LocalSource, check_source_uri, open_source

BAD_URIS = [
    ("", "ingest.source is empty: set it in params.yaml to a local directory or an s3://bucket/prefix URI"),
    ("   ", "ingest.source is empty"),
    ("http://example.com/videos", "http:// sources are not supported; only local directories and "
                                  "s3://bucket/prefix are"),
    ("https://bucket.s3.amazonaws.com/raw", "https:// sources are not supported"),
    ("gs://bucket/raw", "gs:// sources are not supported"),
    ("file:///data/raw", "file:// sources are not supported"),
    ("S3://videos/raw", "write the scheme in lowercase: s3://"),
    ("s3://", "names no bucket: write s3://bucket/prefix"),
    ("s3:///raw", "names no bucket: write s3://bucket/prefix"),
    ("s3:/videos/raw", "is not a valid S3 URI: write s3://bucket/prefix"),
    ("s3://my videos/raw", "'my videos' is not an S3 bucket name (letters, digits, dots, hyphens and"),
    ("s3://user@videos/raw", "'user@videos' is not an S3 bucket name"),
    ("s3://my..videos/raw", "is not an S3 bucket name"),
]


@pytest.mark.parametrize("uri, message", BAD_URIS)
def test_bad_source_uris_say_what_to_fix(uri, message, tmp_path):
    with pytest.raises(SourceError) as err:
        check_source_uri(uri)
    assert message in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(SourceError, match="ingest.source"):  # not a ValueError from deeper down
        open_source(uri, tmp_path / "cache", S3Config())


@pytest.mark.parametrize("uri", ["data/demo/raw", "/abs/raw", "raw videos", "s3://videos", "s3://videos/",
                                 "s3://videos/raw/2024", "s3://my.videos-1/a/b", "s3://" + "a" * 63,
                                 "s3://My_Old_Videos/raw"])  # an older AWS bucket, or another store's
def test_good_source_uris_pass(uri, tmp_path):
    check_source_uri(uri)
    src = open_source(uri, tmp_path / "cache", S3Config())
    assert isinstance(src, S3Source if uri.startswith("s3://") else LocalSource)


def test_s3_source_refuses_a_bad_uri_itself(tmp_path):
    with pytest.raises(SourceError, match="names no bucket"):
        S3Source("s3:///raw", tmp_path, S3Config())


def test_a_local_source_that_is_a_file_says_so(tmp_path):
    (tmp_path / "raw.mp4").write_bytes(b"x")
    with pytest.raises(SourceError, match=r"raw.mp4 is a file, not a directory: set ingest.source in params.yaml "
                                          r"to the directory that holds the raw videos"):
        open_source(str(tmp_path / "raw.mp4"), tmp_path / "cache", S3Config()).list()


def test_s3_params_defaults_and_validation():
    assert from_mapping(S3Config, {}, "ingest.s3").download_workers == 8
    assert from_mapping(S3Config, {"max_retries": 0, "backoff_s": 0, "page_size": 1000}, "ingest.s3")
    for bad, message in [({"download_workers": 0}, "ingest.s3.download_workers must be >= 1, got 0"),
                         ({"max_retries": -1}, "ingest.s3.max_retries must be >= 0"),
                         ({"backoff_s": -0.5}, "ingest.s3.backoff_s must be >= 0"),
                         ({"page_size": 0}, "ingest.s3.page_size must be between 1 and 1000"),
                         ({"page_size": 1001}, "ingest.s3.page_size must be between 1 and 1000")]:
        with pytest.raises(ConfigError, match=message):
            from_mapping(S3Config, bad, "ingest.s3")
    # checked where the stage reads its params, too
    with pytest.raises(ConfigError, match="ingest.s3.download_workers must be >= 1"):
        from_mapping(IngestConfig, {"source": "raw", "s3": {"download_workers": 0}}, "ingest")


def test_folder_clashes_names_the_keys_under_each_clashing_one():
    keys = ["a/b.mp4", "a/b.mp4/c.mp4", "clip", "clip/x.mp4", "clip/y/z.mp4", "fine.mp4", "clipper.mp4"]
    assert folder_clashes(keys) == {"a/b.mp4": ["a/b.mp4/c.mp4"], "clip": ["clip/x.mp4", "clip/y/z.mp4"]}
    assert folder_clashes(["a", "b/a", "ab"]) == {}
