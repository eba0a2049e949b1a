"""relay.execution.gguf_header against the gguf package's reader, on the default model's file."""

from __future__ import annotations

import pytest
from gguf import GGUFReader
from gguf.constants import GGUFValueType

from relay.execution import model_files
from relay.execution.gguf_header import read_header


@pytest.fixture(scope="module")
def both():
    path = model_files.default_model_file()
    return read_header(path), GGUFReader(path)


def test_every_tensor_has_the_readers_offset_type_and_shape(both):
    header, reader = both
    assert list(header.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        mine = header.tensors[t.name]
        assert mine.offset == t.data_offset
        assert mine.qtype == t.tensor_type
        assert mine.shape == tuple(reversed(t.shape.tolist()))
        assert mine.nbytes() == t.n_bytes


def test_every_field_has_the_readers_value_and_string_arrays_their_length(both):
    header, reader = both
    assert list(header.metadata) == [k for k in reader.fields if not k.startswith("GGUF.")]
    for key, value in header.metadata.items():
        field = reader.fields[key]
        string_array = field.types[:2] == [GGUFValueType.ARRAY, GGUFValueType.STRING]
        assert value == (len(field.data) if string_array else field.contents()), key


def test_a_file_cut_inside_its_tensor_data_is_refused_naming_a_tensor(tmp_path):
    src = model_files.default_model_file()
    with open(src, "rb") as f:
        data = f.read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])
    with pytest.raises(ValueError, match="tensor .* runs past the end of the file"):
        read_header(str(cut))
