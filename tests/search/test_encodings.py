"""maxsim.search.encodings: an encoding is an object that is its name, owns what differs between
encodings, and is what every corpus, file and message uses."""

import json
import pickle

import pytest
import torch

from maxsim.compressed import ProductQuantizer, ResidualCodec
from maxsim.search import Corpus, encodings


@pytest.mark.parametrize("name, kind, has_codec, has_scales, per_token", [
    ("float16", encodings.Float, False, False, 256), ("bfloat16", encodings.Float, False, False, 256),
    ("float32", encodings.Float, False, False, 512), ("int8", encodings.OneByte, False, True, 132),
    ("fp8", encodings.OneByte, False, True, 132), ("residual1", encodings.Residual, True, False, 20),
    ("residual2", encodings.Residual, True, False, 36), ("residual4", encodings.Residual, True, False, 68),
    ("residual8", encodings.Residual, True, False, 132), ("pq16", encodings.PQ, True, False, 16),
    ("pq32", encodings.PQ, True, False, 32), ("pq128", encodings.PQ, True, False, 128)])
def test_every_name_parses_to_its_object(name, kind, has_codec, has_scales, per_token):
    enc = encodings.encoding(name)
    assert type(enc) is kind and enc == name and str(enc) == name and repr(enc) == repr(name)
    assert enc.has_codec == has_codec and enc.has_scales == has_scales and enc.exact == (kind is encodings.Float)
    assert enc.bytes_per_token(128) == per_token
    assert {enc: 1}[name] == 1  # hashes as its name
    assert pickle.loads(pickle.dumps(enc)) == enc and type(pickle.loads(pickle.dumps(enc))) is kind
    assert json.loads(json.dumps({"encoding": enc})) == {"encoding": name}
    assert encodings.encoding(enc) is enc


@pytest.mark.parametrize("bad", ["pq0", "pq07", "residual3", "int4", "", "PQ32", 8, None])
def test_a_name_that_means_nothing_is_one_line(bad):
    assert encodings.parse(bad) is None
    with pytest.raises(ValueError, match="encoding must be one of float16, .* pq<m>"):
        encodings.encoding(bad)


def test_the_corpus_holds_and_takes_the_objects():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    docs = [torch.randn(int(n), 32, generator=g) for n in torch.randint(1, 20, (40,), generator=g)]
    for enc in (encodings.Float("float16"), encodings.OneByte("fp8"), encodings.Residual(4), encodings.PQ(8)):
        corpus = Corpus.from_list(docs, encoding=enc) if enc != "pq8" else \
            Corpus.from_list(docs, codec=ProductQuantizer.train(torch.cat(docs * 8), 8))
        assert corpus.encoding == enc and type(corpus.encoding) is type(enc)
        assert corpus.bytes_per_token == enc.bytes_per_token(32)
        assert (corpus.codec is not None) == enc.has_codec
    codec = ResidualCodec.train(torch.cat(docs), 2, num_centroids=8)
    assert encodings.of_codec(codec) == "residual2"
    with pytest.raises(ValueError, match="codec= is a ResidualCodec for encoding 'residual2', but encoding='int8'"):
        Corpus.from_list(docs, encoding="int8", codec=codec)
    with pytest.raises(ValueError, match="no codec to train"):
        encodings.train_codec(torch.cat(docs), "float16")
