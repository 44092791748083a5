"""The cluster's model profiles: their checks, the model folder and servers they make."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from mmreuse.cluster import Cluster, InstanceSpec
from mmreuse.cluster.bench_run import BenchOptions, p_kv_args
from mmreuse.cluster.instance import profile_env, server_argv
from mmreuse.cluster.model import model_files
from mmreuse.cluster.profile import PROFILES, SERVING, TINY, ModelProfile, get_profile
from mmreuse.errors import InvalidArgument


def test_tiny_is_the_model_the_fast_tiers_always_served():
    """The tiny profile writes the folder the cluster wrote before profiles existed."""
    config = json.loads(model_files()["config.json"])
    assert model_files() == model_files(TINY)
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (
        128,
        2,
        256,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (2, 1)
    assert config["rope_scaling"]["mrope_section"] == [8, 12, 12]
    vision = config["vision_config"]
    assert (vision["depth"], vision["embed_dim"], vision["num_heads"], vision["mlp_ratio"]) == (
        1,
        64,
        2,
        2,
    )
    image = json.loads(model_files()["preprocessor_config.json"])
    assert (image["min_pixels"], image["max_pixels"]) == (56 * 56, 112 * 112)
    assert config["max_position_embeddings"] == 4096
    assert config["architectures"] == ["Qwen2VLForConditionalGeneration"]
    assert config["torch_dtype"] == "bfloat16" and TINY.embedding_bytes(16) == 4096


@pytest.mark.parametrize("profile", list(PROFILES.values()), ids=list(PROFILES))
def test_a_profile_s_folder_says_its_sizes(profile):
    files = model_files(profile)
    config = json.loads(files["config.json"])
    vision = config["vision_config"]
    assert config["model_type"] == profile.architecture and config["torch_dtype"] == profile.dtype
    merger = "out_hidden_size" if profile.architecture == "qwen2_5_vl" else "hidden_size"
    width = "hidden_size" if profile.architecture == "qwen2_5_vl" else "embed_dim"
    assert config["hidden_size"] == vision[merger] == profile.hidden
    assert vision["depth"] == profile.vit_depth and vision[width] == profile.vit_width
    assert config["num_hidden_layers"] == profile.layers
    assert config["intermediate_size"] == profile.intermediate
    assert config["num_key_value_heads"] == profile.kv_heads
    hd = config["hidden_size"] // config["num_attention_heads"]
    assert sum(config["rope_scaling"]["mrope_section"]) == hd // 2
    image = json.loads(files["preprocessor_config.json"])
    video = json.loads(files["video_preprocessor_config.json"])
    assert image["min_pixels"] == video["min_pixels"] == profile.min_pixels
    assert image["max_pixels"] == video["max_pixels"] == profile.max_pixels
    assert json.loads(files["tokenizer_config.json"])["model_max_length"] == profile.max_model_len


def test_the_serving_profile_has_serving_shapes():
    """ServeGen's mm-image traffic: median 405 tokens an image, p90 1,224; an embedding of
    hundreds of KB to MB; a context that holds a conversation of such images."""
    assert SERVING.min_image_tokens <= 405 and SERVING.max_image_tokens >= 1224
    assert SERVING.embedding_bytes(405) >= 256 << 10
    assert SERVING.embedding_bytes(SERVING.max_image_tokens) >= 1 << 20
    assert SERVING.max_model_len >= 8 * SERVING.max_image_tokens
    assert SERVING.bind_cores and not TINY.bind_cores
    # Qwen2.5-VL's windowed ViT: encode cost linear in an image's tokens, as on the GPU figures'
    config = json.loads(model_files(SERVING)["config.json"])
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert config["vision_config"]["fullatt_block_indexes"] == list(SERVING.vit_full_blocks)
    four = dataclasses.replace(SERVING, vit_depth=4, vit_full_blocks=(1, 3))
    assert json.loads(model_files(four)["config.json"])["vision_config"][
        "fullatt_block_indexes"
    ] == [1, 3]
    assert config["vision_config"]["window_size"] == 112
    processor = json.loads(model_files(SERVING)["preprocessor_config.json"])
    assert processor["processor_class"] == "Qwen2_5_VLProcessor"
    assert (processor["patch_size"], processor["merge_size"]) == (14, 2)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden": 0}, "hidden must be"),
        ({"hidden": 100, "heads": 3}, r"hidden \(100\) must be a multiple of heads"),
        ({"kv_heads": 3}, "kv_heads"),
        ({"hidden": 96, "heads": 2}, "multiple of 32"),
        ({"vit_width": 65}, r"vit_width \(65\) must be a multiple of vit_heads"),
        ({"min_pixels": 100}, "min_pixels must be"),
        ({"max_pixels": 1000}, "max_pixels must be"),
        ({"kv_cache_gib": 0}, "kv_cache_gib must be"),
        ({"bind_cores": 1}, "bind_cores must be a bool"),
        ({"vit_full_blocks": (0,)}, "vit_full_blocks is Qwen2.5-VL's"),
        ({"architecture": "qwen2_5_vl", "vit_full_blocks": (1,)}, r"in \[0, 1\), got \(1,\)"),
        ({"architecture": "qwen2_5_vl", "vit_depth": 3, "vit_full_blocks": (2, 1)}, "sorted"),
        ({"vit_full_blocks": [0]}, "vit_full_blocks must be a sorted tuple"),
        ({"name": ""}, "name must be"),
        ({"architecture": "llava"}, r"architecture must be one of \['qwen2_5_vl', 'qwen2_vl'\]"),
        ({"dtype": "float16"}, r"dtype must be one of \['bfloat16', 'float32'\]"),
        ({"layers": True}, "layers must be an int"),
    ],
)
def test_a_profile_checks_its_fields(change, match):
    with pytest.raises(InvalidArgument, match=match):
        dataclasses.replace(TINY, **change)


def test_get_profile_names_the_choices():
    assert get_profile("serving") is SERVING and get_profile("tiny") is TINY
    with pytest.raises(InvalidArgument, match=r"profile must be one of \['serving', 'tiny'\]"):
        get_profile("huge")


def test_servers_take_the_profile_s_context_kv_cache_and_cores(tmp_path):
    e = InstanceSpec("E0", "encoder", 8001, profile=SERVING)
    p = InstanceSpec("P0", "prefill", 8002, kv_events_port=9001, replay_port=9002, profile=SERVING)
    argv = server_argv(p, tmp_path / "py", tmp_path, tmp_path)
    assert argv[argv.index("--max-model-len") + 1] == str(SERVING.max_model_len)
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert profile_env(e, cpus=2) == {
        "VLLM_CPU_KVCACHE_SPACE": str(SERVING.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": "0",
    }
    assert profile_env(p, cpus=2)["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    mine = sorted(os.sched_getaffinity(0))
    assert profile_env(p)["VLLM_CPU_OMP_THREADS_BIND"] == str(mine[-1])
    tiny = InstanceSpec("E0", "encoder", 8001)
    assert profile_env(tiny) == {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    argv = server_argv(tiny, tmp_path / "py", tmp_path, tmp_path)
    assert argv[argv.index("--max-model-len") + 1] == "4096"
    with pytest.raises(InvalidArgument, match="profile must be a ModelProfile"):
        InstanceSpec("E0", "encoder", 8001, profile="serving")  # type: ignore[arg-type]


def test_a_cluster_serves_its_profile(tmp_path):
    c = Cluster(tmp_path, encoders=1, prefills=2, profile=SERVING)
    assert {s.profile for s in c.specs()} == {SERVING}
    assert {s.profile for s in Cluster(tmp_path).specs()} == {TINY}
    with pytest.raises(InvalidArgument, match="profile must be a ModelProfile"):
        Cluster(tmp_path, profile="serving")  # type: ignore[arg-type]


def test_bench_options_take_a_profile():
    big = 64 << 20
    assert (
        BenchOptions(policies=("eager",), profile="serving", e_store_bytes=big).model_profile
        is SERVING
    )
    with pytest.raises(InvalidArgument, match=r"^--e-store-bytes: 65536 holds no whole embedding"):
        BenchOptions(policies=("eager",), profile="serving")  # the tiny bench's 64 KiB
    assert BenchOptions(policies=("eager",), profile="serving", ec_connector="example")
    assert BenchOptions(policies=("eager",)).model_profile is TINY
    with pytest.raises(InvalidArgument, match=r"^--profile: must be one of"):
        BenchOptions(policies=("eager",), profile="huge")
    with pytest.raises(InvalidArgument, match=r"^--profile: the local cluster's"):
        BenchOptions(
            policies=("eager",),
            profile="serving",
            e_store_bytes=big,
            pd_urls=("http://127.0.0.1:1",),
        )


def test_p_kv_blocks_size_each_p_and_its_context():
    opts = BenchOptions(
        policies=("eager",), profile="serving", e_store_bytes=64 << 20, p_kv_blocks=128
    )
    # vLLM wants the longest context to fit in the KV cache less one block
    assert p_kv_args(opts) == ("--num-gpu-blocks-override", "128", "--max-model-len", "4064")
    tiny = BenchOptions(policies=("eager",), p_kv_blocks=1000)
    assert p_kv_args(tiny)[-1] == str(TINY.max_model_len)  # never above the profile's
    with pytest.raises(InvalidArgument, match=r"^--p-kv-blocks must be >= 2, got 1"):
        BenchOptions(policies=("eager",), p_kv_blocks=1)
    with pytest.raises(InvalidArgument, match=r"^--p-kv-blocks: the local cluster's"):
        BenchOptions(policies=("eager",), p_kv_blocks=64, pd_urls=("http://127.0.0.1:1",))


def test_the_command_line_offers_the_profiles(capsys):
    pytest.importorskip("torch")  # the command line's parser imports the whole library
    from mmreuse import cli

    assert set(cli.CLUSTER_PROFILES) == set(PROFILES)
    assert cli.main(["cluster", "up", "--profile", "huge"]) == 2
    assert "invalid choice: 'huge'" in capsys.readouterr().err
    assert cli.main(["bench-cluster", "--profile", "huge"]) == 2
    assert "invalid choice: 'huge'" in capsys.readouterr().err


def test_profiles_are_values():
    assert isinstance(SERVING, ModelProfile) and hash(SERVING) == hash(dataclasses.replace(SERVING))
    with pytest.raises(dataclasses.FrozenInstanceError):
        SERVING.hidden = 1  # type: ignore[misc]
