"""Passwords never appear where a Redis URL is shown: `redact`, RedisStore's errors, and the command line."""

import pytest
import redis
from tiny import HashEmbedder, save_tiny

from kvrag.cache.store import RedisStore, redact
from kvrag.cli import main
from kvrag.cli.main import _redacted
from kvrag.errors import StoreError

# Port 1 on loopback: nothing listens, a connect is refused at once.
SECRET_URL = "redis://default:pa/ss@127.0.0.1:1/0?password=qq"


@pytest.mark.parametrize(
    "url, shown",
    [
        # what the old regex got wrong
        ("redis://127.0.0.1:1/0?password=secret", "redis://127.0.0.1:1/0?password=***"),
        ("redis://default:pa/ss@host:6379/0", "redis://default:***@host:6379/0"),
        ("redis://u:p@ss@host/0", "redis://u:***@host/0"),
        (SECRET_URL, "redis://default:***@127.0.0.1:1/0?password=***"),
        ("redis://u:p?x@host/0", "redis://u:***@host/0"),
        ("redis://u:p#x@host/0", "redis://u:***@host/0"),
        ("redis://u:p%40ss@host/0", "redis://u:***@host/0"),
        (
            "redis://host/0?db=1&pass=a&passwd=b&auth=c&Password=d",
            "redis://host/0?db=1&pass=***&passwd=***&auth=***&Password=***",
        ),
        ("redis://host/0?password=a@b&client_name=c", "redis://host/0?password=***&client_name=c"),
        # the usual ones
        ("redis://localhost:6379/0", "redis://localhost:6379/0"),
        ("redis://:hunter2@host:6379/0", "redis://:***@host:6379/0"),
        ("rediss://user:pw@cache.internal:6380/1", "rediss://user:***@cache.internal:6380/1"),
        (
            "rediss://cache.internal:6380/1?ssl_cert_reqs=required",
            "rediss://cache.internal:6380/1?ssl_cert_reqs=required",
        ),
        ("redis://alice@host/0", "redis://alice@host/0"),
        ("redis://alice:@host/0", "redis://alice:***@host/0"),
        ("unix://:pw@/tmp/redis.sock?db=0", "unix://:***@/tmp/redis.sock?db=0"),
        ("user:pw@host:6379", "user:***@host:6379"),
    ],
)
def test_redact(url, shown):
    assert redact(url) == shown


def test_a_password_with_a_slash_or_an_at_reaches_redis_py_whole():
    for url, user, password in (
        ("redis://default:pa/ss@cache.internal:6380/2", "default", "pa/ss"),
        ("redis://u:p@ss@cache.internal:6380/2", "u", "p@ss"),
        ("redis://u:a/b?c#d@cache.internal:6380/2", "u", "a/b?c#d"),
    ):
        kwargs = RedisStore(url).client.connection_pool.connection_kwargs
        got = tuple(kwargs[k] for k in ("username", "password", "host", "port", "db"))
        assert got == (user, password, "cache.internal", 6380, 2)
    kwargs = RedisStore("redis://127.0.0.1:1/0?password=secret").client.connection_pool.connection_kwargs
    assert kwargs["password"] == "secret" and kwargs.get("username") is None


def test_a_down_server_with_a_password_in_the_userinfo_and_the_query():
    with pytest.raises(StoreError) as caught:
        RedisStore(SECRET_URL, socket_timeout=0.2).check()
    text = str(caught.value)
    assert "pa/ss" not in text and "qq" not in text and "'pa'" not in text
    assert "redis://default:***@127.0.0.1:1/0?password=***" in text


def test_an_invalid_url_and_errors_that_echo_it_are_redacted():
    with pytest.raises(StoreError, match="invalid Redis URL") as caught:
        RedisStore("redis://user:hunter2@host:notaport/0")
    assert "hunter2" not in str(caught.value) and "user:***@host" in str(caught.value)

    class Echo:  # a client whose errors embed the URL and the password
        def ping(self):
            raise redis.exceptions.ConnectionError(f"cannot reach {SECRET_URL} (password pa/ss, qq)")

    with pytest.raises(StoreError) as caught:
        RedisStore(SECRET_URL, client=Echo()).check()
    assert "pa/ss" not in str(caught.value) and "qq" not in str(caught.value)

    class Kwarg:
        def ping(self):
            raise redis.exceptions.AuthenticationError("bad password s3cr3t-kw")

    with pytest.raises(StoreError) as caught:
        RedisStore("redis://127.0.0.1:1/0", password="s3cr3t-kw", client=Kwarg()).check()
    assert "s3cr3t-kw" not in str(caught.value)


def test_the_recorded_command_line_is_redacted():
    argv = ["tune", "--index", "i", "--redis", SECRET_URL, "--redis=redis://:pw1@h/0", "a@b:c"]
    recorded = " ".join(_redacted(argv))
    assert "pa/ss" not in recorded and "qq" not in recorded and "pw1" not in recorded and recorded.endswith("a@b:c")


class NamedHashEmbedder(HashEmbedder):
    """HashEmbedder under a name, as a manifest records an embedder (and opening the index asks for it again)."""

    def __init__(self, name=None, device="cpu"):
        super().__init__(name or "hash-bag-of-words", device)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("redact")
    save_tiny(root / "model")
    (root / "docs").mkdir()
    (root / "docs" / "ships.txt").write_text("The harbour of Velloria holds forty ships.")
    return root


@pytest.mark.parametrize("command", ["ingest", "ask"])
def test_the_command_line_never_prints_the_password(setup, capsys, monkeypatch, command):
    monkeypatch.setattr("kvrag.engine.rag.Embedder", NamedHashEmbedder)
    root = setup
    index = root / "index"
    if not index.exists():
        assert (
            main(["ingest", str(root / "docs"), "--index", str(index), "--model", str(root / "model"), "--quiet"]) == 0
        )
    capsys.readouterr()
    if command == "ingest":
        argv = ["ingest", str(root / "docs"), "--index", str(root / "fresh"), "--model", str(root / "model"), "--quiet"]
    else:
        argv = ["ask", "How many ships?", "--index", str(index), "--max-new-tokens", "2"]
    code = main([*argv, "--redis", SECRET_URL])
    out = capsys.readouterr()
    assert code == 2 and out.out == "" and out.err.count("\n") == 1 and out.err.startswith("kvrag: error:")
    assert "pa/ss" not in out.err and "qq" not in out.err and "Start the server" in out.err


@pytest.mark.parametrize(
    "url, bare",
    [
        (SECRET_URL, "redis://default@127.0.0.1:1/0"),
        ("redis://:secret@host:6379/0", "redis://host:6379/0"),
        ("rediss://u:p@ss@host/0?db=1&auth=c", "rediss://u@host/0?db=1"),
        ("redis://host/0", "redis://host/0"),
    ],
)
def test_a_url_without_its_credentials_keeps_the_rest(url, bare):
    from kvrag.cache.store import has_credentials, without_credentials

    assert without_credentials(url) == bare
    assert has_credentials(url) == (url != bare) and not has_credentials(bare)
