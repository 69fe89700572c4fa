import pytest

from service.config import ServiceConfig, load, parse_bytes
from tiercache.errors import InvalidArgument


@pytest.mark.parametrize("text, expected", [(4096, 4096), ("4096", 4096), ("1KiB", 1024),
                                            ("1.5 GiB", 3 << 29), ("2gb", 2_000_000_000)])
def test_sizes_read_with_units(text, expected):
    assert parse_bytes(text) == expected


def test_bad_sizes_say_how_to_write_them():
    with pytest.raises(InvalidArgument, match="4GiB"):
        parse_bytes("lots")


def test_file_then_environment_then_flags(tmp_path):
    path = tmp_path / "tiercache.toml"
    path.write_text('host_budget = "2GiB"\nmax_workers = 3\ndisk = false\n')
    # the file sets three values
    config = load(str(path), environ={})
    assert (config.host_budget, config.max_workers, config.disk) == (2 << 30, 3, False)
    # the environment overrides the file
    config = load(str(path), environ={"TIERCACHE_MAX_WORKERS": "5", "TIERCACHE_DISK": "true"})
    assert (config.max_workers, config.disk) == (5, True)
    # a flag overrides both; unset flags (None) do not
    config = load(str(path), environ={"TIERCACHE_MAX_WORKERS": "5"},
                  flags={"max_workers": "7", "host_budget": None})
    assert (config.max_workers, config.host_budget) == (7, 2 << 30)


def test_defaults_suit_a_laptop_and_put_everything_under_the_data_dir():
    config = load(environ={})
    assert config == ServiceConfig()
    assert config.socket_path == "./tiercache-data/tiercache.sock"
    assert config.engine().disk.path == "./tiercache-data/lmdb"


@pytest.mark.parametrize("source, message", [
    ({"flags": {"max_workers": "many"}}, "max_workers='many'"),
    ({"flags": {"host_budget": "0"}}, "host_budget must be positive"),
    ({"environ": {"TIERCACHE_DISK": "maybe"}}, "not a boolean"),
    ({"environ": {"TIERCACHE_HOST_BUDGT": "1GiB"}}, "unknown setting"),
    ({"flags": {"policy": "random"}}, "eviction policy"),
    ({"flags": {"remote": "redis-cluster://127.0.0.1:7000", "remote_writes": "later"}},
     "remote writes 'later'"),
])
def test_bad_settings_name_the_setting(source, message):
    with pytest.raises(InvalidArgument, match=message):
        load(environ=source.get("environ", {}), flags=source.get("flags"))
