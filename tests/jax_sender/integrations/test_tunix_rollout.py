"""``jax_sender.integrations.tunix.VLLMServerRollout`` driven by Tunix's own code.

Weights: Tunix's ``RLCluster`` (built with the rollout as its
``rollout_engine``) runs ``sync_weights``, which calls the rollout's
``update_params``; the rollout's sender is a real ``WeightSender`` over the
in-memory link (``support.servers.memory_link``) into ``MemoryServer``, an
independent vLLM receiver. A tiny Qwen3 loaded by Tunix from a random
checkpoint must land name for name, byte for byte.

Samples: ``generate`` and ``get_per_token_logps`` (also through
``RLCluster.generate`` and ``get_old_per_token_logps``) against
``support.servers.completions_server``, which checks each request as vLLM 0.33.0's
``CompletionRequest`` would and answers in its schema from a toy model whose
logprobs the tests know.

Everything here needs ``tunix`` (``pip install google-tunix``) except the
first test, which checks what importing the integration without it says.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from jax_sender import TUNIX_QWEN3, MetadataError, SendConfig

from support import ROOT, on_tests_path
from support.pushes import assert_same_tensors, calls
from support.servers.completions_server import CompletionsServer, Refused, check_request
from support.servers.memory_link import memory_sender
from support.tiny_tunix import (
    BOS,
    EOS,
    PAD,
    ToyTokenizer,
    V,
    build_cluster,
    grpo_step,
    hf_checkpoint,
    hugging_face,
    tunix_model,
)

# -- without Tunix ------------------------------------------------------------------

def test_import_without_tunix_names_the_install():
    """Importing the integration where ``tunix`` cannot be imported: one sentence
    naming the install (``tunix`` is blocked in a child where it is installed)."""
    code = ("import sys; sys.modules['tunix'] = None\n"
            "try:\n"
            "    import jax_sender.integrations.tunix\n"
            "except ImportError as e:\n"
            "    print(e)\n"
            "else:\n"
            "    print('imported')\n")
    env = on_tests_path(dict(os.environ, JAX_PLATFORMS="cpu"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=60, cwd=str(ROOT))
    message = out.stdout.strip()
    assert "pip install google-tunix" in message, (message, out.stderr[-2000:])
    assert message.count(". ") == 0 and "\n" not in message  # one sentence
    import jax_sender.integrations  # the package itself imports no framework  # noqa: F401


def test_support_server_refuses_what_vllm_would():
    """The loopback server's checks are live: a misspelt field, a wrong type, an
    out-of-vocabulary token, a bad temperature are refused; a good request passes."""
    ok = dict(prompt=[[2, 3]], max_tokens=4, temperature=0.5, logprobs=0,
              return_token_ids=True, return_tokens_as_token_ids=True)
    check_request(ok, vocab_size=V, max_model_len=64, max_logprobs=20)
    for bad, match in [({"max_token": 4}, "max_token"), ({"max_tokens": "4"}, "max_tokens"),
                       ({"prompt": [[2, 40]]}, "out of vocabulary"),
                       ({"temperature": 3.0}, r"temperature must be in \[0, 2\]"),
                       ({"prompt_logprobs": -2}, "positive value or -1"),
                       ({"prompt": []}, "cannot be empty"), ({"prompt": ""}, "must be provided"),
                       ({"echo": False, "max_tokens": 0}, "max_tokens must be at least 1")]:
        with pytest.raises(Refused, match=match):
            check_request({**ok, **bad}, vocab_size=V, max_model_len=64, max_logprobs=20)


# -- fixtures -------------------------------------------------------------------------

@pytest.fixture
def tunix():
    return pytest.importorskip("tunix", reason="needs Tunix: pip install google-tunix")


@pytest.fixture
def completions():
    server = CompletionsServer(vocab_size=V, eos_id=EOS)
    yield server
    server.close()


@pytest.fixture
def link():
    """A WeightSender with TUNIX_QWEN3 over the in-memory link, its MemoryServer."""
    sender, servers, _ = memory_sender(mapping=TUNIX_QWEN3)
    yield sender, servers[0]
    sender.close()
    servers[0].close()


# -- weights: RLCluster.sync_weights -> update_params -> the servers ------------------

def test_sync_weights_lands_the_model(tunix, tmp_path, link, completions):
    """RLCluster.sync_weights pushes the actor asynchronously; the checkpoint lands
    byte for byte, stamped ``sync-1``; a changed actor lands on the next sync, and
    ``generate`` waits for that push before it asks the server for samples."""
    from flax import nnx
    from tunix.rl.rollout import base_rollout

    from jax_sender.integrations.tunix import VLLMServerRollout
    sender, server = link
    first, second = hf_checkpoint(0), hf_checkpoint(1)
    engine = functools.partial(VLLMServerRollout, completions.url, sender=sender)
    cluster = build_cluster(tunix_model(tmp_path / "a", first), engine)
    rollout = cluster.rollout
    assert isinstance(rollout, VLLMServerRollout) and rollout.model() is None
    assert (rollout.pad_id(), rollout.eos_id()) == (PAD, EOS)  # from RLCluster's tokenizer

    cluster.sync_weights()
    rollout.wait_for_push()
    assert_same_tensors(server.store, first)
    assert server.weight_version == rollout.weight_version == "sync-1"

    # The trainer's weights change (as after a step); the push of them is held at
    # /finish_weight_update until released, so sync_weights returning proves it
    # did not wait for the push, and generate must wait for it.
    nnx.update(cluster.actor_trainer.model,
               nnx.state(tunix_model(tmp_path / "b", second), nnx.Param))
    held = threading.Event()
    server.hold["/finish_weight_update"] = held
    cluster.sync_weights()
    assert server.weight_version == "sync-1"
    releaser = threading.Timer(0.3, held.set)
    releaser.start()
    try:
        cluster.generate(["ab"])
    finally:
        held.set()
        releaser.cancel()
    assert server.weight_version == rollout.weight_version == "sync-2"
    assert_same_tensors(server.store, second)
    finish = calls(server, "/finish_weight_update")[-1]
    assert completions.arrivals[0] >= finish.answered  # samples asked after the push ended
    assert isinstance(rollout, base_rollout.BaseRollout)
    rollout.close()


def test_the_hand_written_names_are_tunixs_loader_inverted(tunix, tmp_path):
    """``hugging_face`` (what the GPU tests hold vLLM's checksums against after a
    training step) turns the model Tunix's loader built back into its checkpoint."""
    from flax import nnx
    checkpoint = hf_checkpoint(4)
    assert_same_tensors(hugging_face(nnx.state(tunix_model(tmp_path, checkpoint), nnx.Param)),
                  checkpoint)


def test_one_grpo_step_lands_the_trained_actor(tunix, tmp_path, link, completions):
    """Tunix's own GRPO learner runs one step with the rollout: it samples and
    scores through the completions route, updates the actor, and its
    ``sync_weights`` pushes the trained weights, which land byte for byte."""
    from flax import nnx

    from jax_sender.integrations.tunix import VLLMServerRollout
    sender, server = link
    checkpoint = hf_checkpoint(5)
    engine = functools.partial(VLLMServerRollout, completions.url, sender=sender)
    cluster = build_cluster(tunix_model(tmp_path, checkpoint), engine,
                            max_tokens_to_generate=4, temperature=1.0, max_prompt_length=8)
    cluster.sync_weights()  # the servers start from the checkpoint
    grpo_step(cluster)
    cluster.rollout.wait_for_push()
    trained = hugging_face(nnx.state(cluster.actor_trainer.model, nnx.Param))
    assert_same_tensors(server.store, trained)
    assert server.weight_version == cluster.rollout.weight_version == "sync-2"
    changed = [n for n in trained if trained[n].tobytes() != checkpoint[n].tobytes()]
    assert len(changed) > len(trained) // 2, changed  # the step trained the actor
    tok = ToyTokenizer()
    asked = sorted(p for r in completions.requests for p in r["prompt"])
    assert asked == sorted([[BOS] + tok.encode(p) for p in ("ab", "xyz")] * 2), asked
    assert not completions.refused
    cluster.rollout.close()


def test_lora_state_refused_before_any_request(tunix, tmp_path, link, completions):
    """A LoRA actor: sync_weights (filter_types names nnx.LoRAParam) and a Param
    state holding adapters are refused with MetadataError; no server heard of it."""
    qwix = pytest.importorskip("qwix")
    from flax import nnx

    from jax_sender.integrations.tunix import VLLMServerRollout
    sender, server = link
    base = tunix_model(tmp_path, hf_checkpoint(0))
    provider = qwix.LoraProvider(module_path=".*q_proj|.*v_proj", rank=2, alpha=2.0)
    actor = qwix.apply_lora_to_model(base, provider, rngs=nnx.Rngs(0), **base.get_model_input())
    engine = functools.partial(VLLMServerRollout, completions.url, sender=sender)
    cluster = build_cluster(actor, engine)
    calls = len(server.log)
    with pytest.raises(MetadataError, match="LoRA"):
        cluster.sync_weights()
    with pytest.raises(MetadataError, match=r"8 LoRA adapter weight\(s\).*merge"):
        cluster.rollout.update_params(nnx.state(cluster.actor_trainer.model, nnx.Param),
                                      (nnx.Param,))
    assert len(server.log) == calls and not server.store
    assert not completions.requests
    cluster.rollout.close()


@pytest.mark.parametrize("packed", [True, False])
def test_an_explicit_mesh_actor_lands(tunix, tmp_path, packed):
    """Arrays on a mesh's Explicit axes (jax.make_mesh's default) are moved
    off their mesh by the sender and land, packed or not."""
    from jax_sender.integrations.tunix import VLLMServerRollout
    sender, servers, _ = memory_sender(SendConfig(packed=packed), mapping=TUNIX_QWEN3)
    try:
        checkpoint = hf_checkpoint(2)
        engine = functools.partial(VLLMServerRollout, servers[0].url, sender=sender)
        cluster = build_cluster(tunix_model(tmp_path, checkpoint), engine,
                                mesh=jax.make_mesh((1, 1), ("fsdp", "tp")))
        cluster.sync_weights()
        cluster.rollout.wait_for_push()
        assert servers[0].weight_version == cluster.rollout.weight_version == "sync-1"
        assert_same_tensors(servers[0].store, checkpoint)
        cluster.rollout.close()
    finally:
        sender.close()
        servers[0].close()



def test_a_failed_push_is_raised_by_generate_then_repaired(tunix, tmp_path, link, completions):
    """A push the server refuses mid-update (in the background) fails the next
    generate before any sample is asked for; the next sync reconnects and lands."""
    from jax_sender import SendError
    from jax_sender.integrations.tunix import VLLMServerRollout
    sender, server = link
    checkpoint = hf_checkpoint(3)
    engine = functools.partial(VLLMServerRollout, completions.url, sender=sender)
    cluster = build_cluster(tunix_model(tmp_path, checkpoint), engine, max_tokens_to_generate=2)
    server.fail["/update_weights"] = 500
    cluster.sync_weights()  # returns: the push runs in the background
    with pytest.raises(SendError):
        cluster.generate(["ab"])
    assert not completions.requests and server.weight_version == "default"
    del server.fail["/update_weights"]
    cluster.sync_weights()
    cluster.rollout.wait_for_push()
    assert server.weight_version == cluster.rollout.weight_version == "sync-2"
    assert_same_tensors(server.store, checkpoint)
    assert len(cluster.generate(["ab"]).tokens) == 1
    cluster.rollout.close()


# -- samples: generate and get_per_token_logps -----------------------------------------

def greedy(server: CompletionsServer, prompt: list[int], steps: int) -> list[int]:
    out, prev = [], prompt[-1]
    while len(out) < steps:
        prev = int(np.argmax(server.logits[prev]))
        out.append(prev)
        if prev == EOS:
            break
    return out


def rollout_on(urls, **kwargs):
    from jax_sender.integrations.tunix import VLLMServerRollout
    kwargs.setdefault("tokenizer", ToyTokenizer())
    return VLLMServerRollout(urls, mapping=TUNIX_QWEN3, lazy_connect=True, **kwargs)


def test_generate_token_ids_and_logprobs(tunix, completions):
    from tunix.rl.rollout import base_rollout
    rollout = rollout_on(completions.url, timeout_s=10)
    config = base_rollout.RolloutConfig(max_tokens_to_generate=6, temperature=0.0,
                                        return_logprobs=True, max_prompt_length=8)
    prompts = ["hello", "hi", "abc"]
    out = rollout.generate(prompts, config)
    tok = ToyTokenizer()
    ids = [[BOS] + tok.encode(p) for p in prompts]  # Tunix's vLLM sampler: a BOS in front
    assert out.left_padded_prompt_tokens.dtype == np.int32
    assert out.left_padded_prompt_tokens.tolist() == [[PAD] * (8 - len(p)) + p for p in ids]
    assert out.logits is None
    for k, p in enumerate(ids):
        want = greedy(completions, p, 6)
        assert out.tokens[k].dtype == np.int32 and out.tokens[k].tolist() == want
        assert out.text[k] == tok.decode(want)
        prev = [p[-1]] + want[:-1]
        np.testing.assert_array_equal(
            out.logprobs[k], np.float32([completions.table[a, b] for a, b in zip(prev, want)]))
    assert not completions.refused
    sent = completions.requests[-1]
    assert sent["prompt"] == ids and sent["max_tokens"] == 6 and sent["temperature"] == 0.0
    assert sent["logprobs"] == 0 and sent["stop_token_ids"] == [EOS]
    assert sent["return_token_ids"] is True and sent["return_tokens_as_token_ids"] is True
    rollout.close()


def test_generate_sampling_fields_n_and_long_prompts(tunix, completions):
    """top_p, top_k, seed and rollout_vllm_sampling_kwargs reach the request; n
    samples per prompt come prompt by prompt; a prompt longer than
    max_prompt_length pads to the next power of 2, as Tunix's vLLM sampler."""
    from tunix.rl.rollout import base_rollout
    rollout = rollout_on(completions.url, timeout_s=10)
    config = base_rollout.RolloutConfig(
        max_tokens_to_generate=4, temperature=0.8, top_p=0.9, top_k=5, seed=np.int32(7),
        max_prompt_length=4, rollout_vllm_sampling_kwargs={"min_p": 0.0})
    out = rollout.generate(["abcdef", "x"], config, n=2)
    assert out.left_padded_prompt_tokens.shape == (4, 8)  # 7 tokens -> 8
    rows = out.left_padded_prompt_tokens.tolist()
    assert rows[0] == rows[1] and rows[2] == rows[3] and rows[2][-2:] == [BOS, 3 + ord("x") % 29]
    assert len(out.tokens) == 4 and out.logprobs is None
    sent = completions.requests[-1]
    assert (sent["top_p"], sent["top_k"], sent["seed"], sent["n"], sent["min_p"]) == \
        (0.9, 5, 7, 2, 0.0)
    assert "logprobs" not in sent and not completions.refused
    with pytest.raises(ValueError, match="logprobs cannot be passed"):
        rollout.generate(["a"], config, logprobs=3)
    rollout.close()


def test_generate_without_tokenizer_and_split_between_servers(tunix, completions):
    """Pre-tokenized prompts without a tokenizer (pad_id/eos_id given), a batch
    split between two servers: the same samples, in order, as one server gives."""
    from tunix.rl.rollout import base_rollout
    other = CompletionsServer(vocab_size=V, eos_id=EOS)
    try:
        prompts = [[2, 5, 6], [2, 7], [2, 9, 9, 9], [2, 4], [2, 8]]
        config = base_rollout.RolloutConfig(max_tokens_to_generate=5, temperature=0.0,
                                            max_prompt_length=4)
        one = rollout_on(completions.url, tokenizer=None, pad_id=PAD, eos_id=EOS)
        two = rollout_on([completions.url, other.url], tokenizer=None, pad_id=PAD, eos_id=EOS)
        a, b = one.generate(prompts, config), two.generate(prompts, config)
        assert [t.tolist() for t in a.tokens] == [t.tolist() for t in b.tokens] == \
            [greedy(completions, p, 5) for p in prompts]
        assert a.text == b.text and a.text[0] == "".join(
            f"<{t}>" for t in a.tokens[0].tolist() if t != EOS)  # the server's own text
        assert [len(r["prompt"]) for r in completions.requests[1:] + other.requests] == [3, 2]
        np.testing.assert_array_equal(a.left_padded_prompt_tokens, b.left_padded_prompt_tokens)
        one.close()
        two.close()
    finally:
        other.close()


def test_per_token_logps(tunix, completions):
    """Pads anywhere are not part of a sequence (as Tunix's process_ids reads
    them); each completion token's logprob is the server's raw prompt logprob;
    pad positions are 0; an all-pad completion is not sent."""
    rollout = rollout_on(completions.url, timeout_s=10)
    prompt = np.array([[PAD, PAD, BOS, 5], [BOS, 7, 8, 9], [PAD, BOS, 3, 4]], dtype=np.int32)
    completion = np.array([[4, 6, EOS, PAD], [PAD, PAD, PAD, PAD], [11, 12, 13, 14]],
                          dtype=np.int32)
    got = rollout.get_per_token_logps(jax.numpy.asarray(prompt), jax.numpy.asarray(completion))
    assert isinstance(got, jax.Array) and got.shape == (3, 4) and got.dtype == np.float32
    want = np.zeros((3, 4), np.float32)
    for b in range(3):
        seq = [int(t) for t in prompt[b] if t != PAD]
        for c in range(4):
            if completion[b, c] != PAD:
                want[b, c] = completions.table[seq[-1], completion[b, c]]
                seq.append(int(completion[b, c]))
    np.testing.assert_array_equal(np.asarray(got), want)
    sent = completions.requests[-1]
    assert sent["prompt"] == [[BOS, 5, 4, 6, EOS], [BOS, 3, 4, 11, 12, 13, 14]]
    assert (sent["echo"], sent["max_tokens"], sent["prompt_logprobs"]) == (True, 0, 0)
    assert not completions.refused
    rollout.close()


def test_through_rl_cluster_generate_and_old_logps(tunix, tmp_path, link, completions):
    """RLCluster.generate (micro-batched) and get_old_per_token_logps call the
    rollout as a learner does; the shapes are what the GRPO learner pads."""
    from jax_sender.integrations.tunix import VLLMServerRollout
    sender, _ = link
    engine = functools.partial(VLLMServerRollout, completions.url, sender=sender)
    cluster = build_cluster(tunix_model(tmp_path, hf_checkpoint(0)), engine,
                            max_tokens_to_generate=4, temperature=0.0, max_prompt_length=8)
    out = cluster.generate(["ab", "abc", "q"], micro_batch_size=2)
    assert out.left_padded_prompt_tokens.shape == (3, 8) and len(out.tokens) == 3
    completion = np.full((3, 4), PAD, np.int32)
    for k, t in enumerate(out.tokens):
        completion[k, :len(t)] = t
    logps = cluster.get_old_per_token_logps(jax.numpy.asarray(out.left_padded_prompt_tokens),
                                            jax.numpy.asarray(completion))
    assert logps.shape == (3, 4)
    for k in range(3):
        seq = [int(t) for t in out.left_padded_prompt_tokens[k] if t != PAD]
        for c, t in enumerate(out.tokens[k].tolist()):
            assert np.float32(logps[k, c]) == np.float32(completions.table[seq[-1], t])
            seq.append(t)
    assert not completions.refused
    cluster.rollout.close()


# -- deadlines and refusals ---------------------------------------------------------------

def test_a_server_that_never_answers_ends_within_the_deadline(tunix):
    from tunix.rl.rollout import base_rollout

    from uniqueid import VLLMTimeout
    silent = CompletionsServer(vocab_size=V, eos_id=EOS, hang=True)
    try:
        rollout = rollout_on(silent.url, timeout_s=1.0)
        for call in (lambda: rollout.generate(["ab"], base_rollout.RolloutConfig()),
                     lambda: rollout.get_per_token_logps(np.array([[BOS, 3]]),
                                                         np.array([[4, 5]]))):
            t0 = time.monotonic()
            with pytest.raises(VLLMTimeout):
                call()
            assert time.monotonic() - t0 < 1.0 + 1.0
        rollout.close()
    finally:
        silent.close()


def test_a_refused_request_says_what_vllm_said(tunix, completions):
    from tunix.rl.rollout import base_rollout

    from uniqueid import VLLMHTTPError
    rollout = rollout_on(completions.url, timeout_s=10)
    with pytest.raises(VLLMHTTPError, match=r"temperature must be in \[0, 2\]"):
        rollout.generate(["ab"], base_rollout.RolloutConfig(temperature=3.0))
    with pytest.raises(ValueError, match="all padding"):
        rollout.get_per_token_logps(np.array([[PAD, PAD]]), np.array([[4, PAD]]))
    rollout.close()
    with pytest.raises(RuntimeError, match="closed"):
        rollout.generate(["ab"], base_rollout.RolloutConfig())


# -- MaxText's trainer: the model under ``base`` -------------------------------------------

def test_strip_prefix_names_maxtexts_adapter_tree(tunix):
    """MaxText's TunixMaxTextAdapter holds the model as ``base``: under
    ``strip_prefix(..., "base")`` a MAXTEXT mapping gives, through the core's own
    naming, what MaxText's to_huggingface hooks give (tests/support/zoo_golden)."""
    from jax_sender import maxtext_qwen3, named_arrays
    from jax_sender.integrations.tunix import strip_prefix

    from support import make_zoo_golden as golden
    case = "qwen3_scanned"
    want = golden.load(os.path.join(os.path.dirname(golden.__file__), "zoo_golden",
                                    f"{case}.npz"))
    inner = golden.maxtext_tree(case)["params"]
    tree = {"base": jax.tree.map(lambda x: {"value": x}, inner)}  # an nnx.State's leaves
    mapping = strip_prefix(maxtext_qwen3(num_layers=golden.DIMS["layers"]), "base")
    got = {name: np.asarray(mapping.apply(path, leaf))
           for name, path, leaf in named_arrays(tree, mapping)}
    assert_same_tensors(got, want)
    with pytest.raises(MetadataError, match="not under 'base'"):
        named_arrays({"other": inner}, mapping)


def test_answers_not_of_vllms_shape_are_refused(tunix):
    """Answers the rollout cannot trust (no token ids, a choice missing, a
    prompt logprob missing) raise VLLMProtocolError naming what is wrong."""
    from tunix.rl.rollout import base_rollout

    from uniqueid import VLLMProtocolError

    def drop_token_ids(body):
        for c in body["choices"]:
            c["token_ids"] = None
        return body

    def drop_a_choice(body):
        body["choices"] = body["choices"][1:]
        return body

    def drop_prompt_logprobs(body):
        for c in body["choices"]:
            if c["prompt_logprobs"]:
                c["prompt_logprobs"][-1] = {}
        return body

    config = base_rollout.RolloutConfig(max_tokens_to_generate=2)
    for mangle, call, match in [
            (drop_token_ids, lambda r: r.generate(["ab"], config), "without token_ids"),
            (drop_a_choice, lambda r: r.generate(["ab", "cd"], config), "not the 2 asked for"),
            (drop_prompt_logprobs,
             lambda r: r.get_per_token_logps(np.array([[BOS, 3]]), np.array([[4, 5]])),
             "without the logprob of token 5")]:
        server = CompletionsServer(vocab_size=V, eos_id=EOS, mangle=mangle)
        try:
            rollout = rollout_on(server.url, timeout_s=10)
            with pytest.raises(VLLMProtocolError, match=match):
                call(rollout)
            rollout.close()
        finally:
            server.close()


# -- answers vLLM never sends: each refused, naming the route and the field ---------------

def _set(path, value):
    """A mangle that sets ``answer[path...]`` (the first choice's field, say)."""
    def mangle(body):
        obj = body
        for key in path[:-1]:
            obj = obj[key]
        obj[path[-1]] = value(obj[path[-1]]) if callable(value) else value
        return body
    return mangle


def _generate(logprobs: bool = True, tokenizer: bool = True):
    def call(rollout_of):
        from tunix.rl.rollout import base_rollout
        rollout = rollout_of(tokenizer=ToyTokenizer() if tokenizer else None)
        config = base_rollout.RolloutConfig(max_tokens_to_generate=4, return_logprobs=logprobs)
        return rollout.generate([[BOS, 3], [BOS, 4]], config)
    return call


def _logps(rollout_of):
    return rollout_of().get_per_token_logps(np.array([[BOS, 3]]), np.array([[4, 5]]))


FIRST = ("choices", 0)
NOT_VLLMS = {
    "a logprob of NaN": (_set((*FIRST, "logprobs", "token_logprobs", 0), float("nan")),
                         _generate(), "logprobs.token_logprobs[0] nan"),
    "a logprob of inf": (_set((*FIRST, "logprobs", "token_logprobs", 0), float("inf")),
                         _generate(), "logprobs.token_logprobs[0] inf"),
    "a logprob of -inf": (_set((*FIRST, "logprobs", "token_logprobs", 0), float("-inf")),
                          _generate(), "logprobs.token_logprobs[0] -inf"),
    "a positive logprob": (_set((*FIRST, "logprobs", "token_logprobs", 0), 0.25),
                           _generate(), "logprobs.token_logprobs[0] 0.25"),
    "a logprob that is a string": (_set((*FIRST, "logprobs", "token_logprobs", 0), "-1"),
                                   _generate(), "logprobs.token_logprobs[0] '-1'"),
    "logprobs not an object": (_set((*FIRST, "logprobs"), [0.0]), _generate(), "logprobs [0.0]"),
    "5000 tokens for max_tokens=4": (_set((*FIRST, "token_ids"), list(range(5000))),
                                     _generate(logprobs=False), "5000 token_ids"),
    "a token id that is a bool": (_set((*FIRST, "token_ids"), [True]), _generate(False),
                                  "token_ids [True]"),
    "a token id past int32": (_set((*FIRST, "token_ids"), [2**40]), _generate(False),
                              "token_ids [1099511627776]"),
    "a prompt token id past int32": (_set((*FIRST, "prompt_token_ids"), [2**31, 3]),
                                     _generate(), "prompt_token_ids [2147483648, 3]"),
    "an index of null": (_set((*FIRST, "index"), None), _generate(), "index fields are [None, 1]"),
    "an index that is a string": (_set((*FIRST, "index"), "0"), _generate(), "index fields"),
    "prompt_token_ids a number": (_set((*FIRST, "prompt_token_ids"), 5), _generate(),
                                  "prompt_token_ids 5"),
    "text not a string": (_set((*FIRST, "text"), None), _generate(tokenizer=False), "text None"),
    "a prompt logprob of NaN": (_set((*FIRST, "prompt_logprobs", 3, "5", "logprob"),
                                     float("nan")), _logps, "prompt_logprobs[3] of token 5 nan"),
    "a positive prompt logprob": (_set((*FIRST, "prompt_logprobs", 2, "4", "logprob"), 3.0),
                                  _logps, "prompt_logprobs[2] of token 4 3.0"),
    "prompt_token_ids a number (echo)": (_set((*FIRST, "prompt_token_ids"), 5), _logps,
                                         "prompt_token_ids 5"),
}


@pytest.mark.parametrize("mangle,call,field", NOT_VLLMS.values(), ids=NOT_VLLMS.keys())
def test_an_answer_vllm_never_sends_is_refused_naming_the_route_and_field(tunix, mangle, call,
                                                                           field):
    """Before, the logprobs reached the RL loss (NaN, inf, positive), 5000 tokens
    came back for max_tokens=4, a text of null became "None", an index of
    null or prompt_token_ids of 5 escaped as a builtin TypeError, and a token
    id past int32 as a bare OverflowError."""
    from uniqueid import VLLMProtocolError
    server = CompletionsServer(vocab_size=V, eos_id=EOS, mangle=mangle)
    rollouts = []

    def rollout_of(**kwargs):
        kwargs.setdefault("tokenizer", ToyTokenizer())
        rollouts.append(rollout_on(server.url, timeout_s=10, pad_id=PAD, eos_id=EOS, **kwargs))
        return rollouts[-1]
    try:
        with pytest.raises(VLLMProtocolError) as e:
            call(rollout_of)
        assert e.value.route == "/v1/completions"
        assert str(e.value).startswith(f"POST {server.url}/v1/completions answered ")
        assert field in str(e.value), str(e.value)
    finally:
        for rollout in rollouts:
            rollout.close()
        server.close()


def test_what_vllm_can_send_at_the_edges_passes(tunix):
    """Logprobs of exactly 0.0 and vLLM's -9999.0 (its -inf), max_tokens tokens
    exactly, and the choices in another order than their indices: all taken."""
    from tunix.rl.rollout import base_rollout

    def edges(body):
        first = body["choices"][0]
        first["logprobs"]["token_logprobs"][:2] = [0.0, -9999.0]
        body["choices"].reverse()
        return body
    server = CompletionsServer(vocab_size=V, eos_id=EOS, mangle=edges)
    try:
        rollout = rollout_on(server.url, timeout_s=10)
        config = base_rollout.RolloutConfig(max_tokens_to_generate=4, return_logprobs=True,
                                            temperature=0.0)
        prompts = [[BOS, 3], [BOS, 4]]
        out = rollout.generate(prompts, config)
        assert out.logprobs[0][:2].tolist() == [0.0, -9999.0]
        for k, p in enumerate(prompts):
            assert out.tokens[k].tolist() == greedy(server, p, 4)  # in prompt order
        rollout.close()
    finally:
        server.close()


@pytest.mark.parametrize("timeout_s", [1e10, float("inf"), 0, True])
def test_a_timeout_no_wait_can_take_is_refused_when_made(tunix, timeout_s):
    """Past 1e9 s a timed wait overflows later: refused with the rollout's own name."""
    with pytest.raises(ValueError, match=r"timeout_s must be a number of seconds above 0 and "
                                         r"at most 1e\+09"):
        rollout_on("http://127.0.0.1:1", timeout_s=timeout_s)
