"""The staging payload of a fetch unit (Note [staging kinds] in _zero/_staging.py): each kind built
by its constructor and moved through ``landed`` and ``on_device`` as a unit does, and every
combination of fields a kind does not have refused."""
import pytest
import torch

from infinity._zero._staging import Source, Staging
from infinity.errors import InvariantError

NUMEL = 4


def _buffer():
    return torch.arange(NUMEL + 2, dtype=torch.float32)  # a pool or gathered buffer: longer than the shard


def _copy_to_device(src):
    """What acc.start_copy_to_device returns: a new device shard and its event."""
    return src.clone(), "event"


def test_resident_reads_the_store_own_shard_and_is_not_cached():
    st = Staging.resident()
    assert st.kind is Source.RESIDENT and not st.in_flight
    assert st.host_shard(NUMEL) is None  # the unit copies the store's own shard
    assert not st.to_cache and st.recycled is None
    shard = torch.ones(NUMEL)
    on = st.on_device(shard, None, shard).device  # no accelerator: the store's tensor is the device shard
    assert on.shard is shard and not on.copied


@pytest.mark.parametrize("build, kind, to_cache", [(Staging.cached, Source.CACHED, False),
                                                   (Staging.handed_off, Source.HANDED_OFF, True)])
def test_a_host_copy_is_copied_whole(build, kind, to_cache):
    shard = torch.ones(NUMEL)
    st = build(shard)
    assert st.kind is kind and not st.in_flight and st.recycled is None
    assert st.host_shard(NUMEL) is shard and st.to_cache is to_cache
    st = st.on_device(*_copy_to_device(shard), shard)
    assert st.device.copied and st.device.source is shard and torch.equal(st.device.shard, shard)


def test_a_pool_read_gets_its_buffer_when_it_lands():
    st = Staging.pool_read("read")
    assert st.kind is Source.POOL_READ and st.in_flight and st.host is None
    buf = _buffer()
    st = st.landed(buf)
    assert not st.in_flight and st.host is buf and st.to_cache and st.recycled is None
    src = st.host_shard(NUMEL)
    assert src.numel() == NUMEL and src.data_ptr() == buf.data_ptr()
    st = st.on_device(*_copy_to_device(src), src)
    assert st.device.copied and st.device.h2d == "event"


def test_a_direct_read_keeps_its_gathered_buffer_for_the_recycler():
    into = _buffer()
    st = Staging.direct_read("read", into)
    assert st.kind is Source.DIRECT_READ and st.in_flight and st.recycled is into
    st = st.landed(into)
    assert not st.in_flight and st.host is into and st.recycled is into and st.to_cache
    src = st.host_shard(NUMEL)
    st = st.on_device(src, None, src)  # no accelerator: the parameters are views of the gathered buffer
    assert not st.device.copied and st.device.shard is src


@pytest.mark.parametrize("kind, fields, refused", [
    (Source.RESIDENT, {"host": torch.ones(1)}, "RESIDENT staging with a host tensor"),
    (Source.RESIDENT, {"read": "read"}, "RESIDENT staging with a read in flight"),
    (Source.CACHED, {}, "CACHED staging with no host tensor"),
    (Source.HANDED_OFF, {"host": torch.ones(1), "read": "read"}, "HANDED_OFF staging with a read in flight"),
    (Source.POOL_READ, {}, "POOL_READ staging with neither a read nor a buffer"),
    (Source.POOL_READ, {"read": "read", "host": torch.ones(1)}, "POOL_READ staging with both"),
    (Source.DIRECT_READ, {"read": "read"}, "DIRECT_READ staging with no host tensor"),
])
def test_a_field_the_kind_has_not_is_refused(kind, fields, refused):
    with pytest.raises(InvariantError, match=refused):
        Staging(kind, **fields)


def test_the_device_half_waits_for_the_read():
    st = Staging.direct_read("read", _buffer())
    with pytest.raises(InvariantError, match="DIRECT_READ staging with a device shard while its read is in flight"):
        st.on_device(torch.ones(NUMEL), "event", torch.zeros(NUMEL))


def test_a_staging_is_not_changed_in_place():
    st = Staging.pool_read("read")
    with pytest.raises(AttributeError):
        st.read = None  # type: ignore[misc]
    assert st.landed(_buffer()) is not st and st.in_flight
