"""ChatTemplate: loading, transformers-compatible rendering, and Tandem's Qwen3.5-style template (spec §11.2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tandem.chat import ChatTemplate, ChatTemplateError

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = (ROOT / "tools" / "qwen3_5_chat_template.jinja").read_text(encoding="utf-8")
SPECIALS: dict[str, str | None] = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city <b>now</b> & later — «météo»",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
CALL = {"type": "function", "function": {"name": "get_weather",
                                         "arguments": {"city": "Zürich", "days": 3, "opts": {"units": "C"},
                                                       "tags": ["a", "b"], "note": None, "hot": True}}}

CONVERSATIONS: dict[str, dict[str, Any]] = {
    "plain": {"messages": [{"role": "user", "content": "  Hi there \n"}]},
    "system": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
    "multi_turn": {"messages": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": [{"type": "text", "text": "And 3+3?"}]},
        {"role": "assistant", "content": "6", "reasoning_content": "easy"},
    ], "add_generation_prompt": False},
    "tools": {"messages": [{"role": "system", "content": "You are helpful."},
                           {"role": "user", "content": "Weather in Zürich?"}], "tools": [WEATHER_TOOL]},
    "tools_no_system": {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER_TOOL]},
    "tool_calls_and_responses": {"messages": [
        {"role": "user", "content": "Weather in Zürich and Bern?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "two calls", "tool_calls": [
            CALL, {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Bern"}}}]},
        {"role": "tool", "content": "sunny, 20C"},
        {"role": "tool", "content": "rain, 12C"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": [{"type": "text", "text": "cloudy"}]},
    ], "tools": [WEATHER_TOOL]},
    "thinking_off": {"messages": [{"role": "user", "content": "Hi"}], "enable_thinking": False},
    "thinking_on_explicit": {"messages": [{"role": "user", "content": "Hi"}], "enable_thinking": True},
}


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate(TEMPLATE, SPECIALS)


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    inner = Tokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, chat_template=TEMPLATE,
                                                eos_token="<|im_end|>", pad_token="<|endoftext|>")


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_matches_transformers(name: str, template: ChatTemplate, hf_tokenizer: Any) -> None:
    case = dict(CONVERSATIONS[name])
    messages = case.pop("messages")
    ours = template.render(messages, **case)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, **{"add_generation_prompt": True, **case})
    assert ours == theirs


def test_spec_example(template: ChatTemplate) -> None:
    out = template.render([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}])
    assert out == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    off = template.render([{"role": "user", "content": "Hi"}], enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_tools_block_and_calls(template: ChatTemplate) -> None:
    case = CONVERSATIONS["tool_calls_and_responses"]
    out = template.render(case["messages"], tools=case["tools"])
    tools_line = "\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n</tools>"
    assert out.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>"
                          + tools_line)  # tojson: no HTML escaping, non-ASCII kept, key order kept
    assert "</IMPORTANT><|im_end|>\n<|im_start|>user\nWeather in Zürich and Bern?<|im_end|>\n" in out
    assert ("<|im_start|>assistant\n<think>\ntwo calls\n</think>\n\nLet me check.\n\n<tool_call>\n"
            "<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
            "<parameter=opts>\n{\"units\": \"C\"}\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n"
            "<parameter=note>\nNone\n</parameter>\n<parameter=hot>\nTrue\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nBern\n</parameter>\n</function>\n</tool_call>"
            "<|im_end|>\n") in out
    assert ("<|im_start|>user\n<tool_response>\nsunny, 20C\n</tool_response>\n<tool_response>\nrain, 12C\n"
            "</tool_response><|im_end|>\n") in out
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=get_weather>" in out
    assert out.endswith("<tool_response>\ncloudy\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n")


def test_reasoning_dropped_before_last_query(template: ChatTemplate) -> None:
    out = template.render(CONVERSATIONS["multi_turn"]["messages"], add_generation_prompt=False)
    assert out == ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
                   "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n<think>\neasy\n</think>\n\n6"
                   "<|im_end|>\n")


def test_errors(template: ChatTemplate) -> None:
    with pytest.raises(ChatTemplateError, match="only allowed first"):
        template.render([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    with pytest.raises(ChatTemplateError, match="no messages"):
        template.render([])
    with pytest.raises(ChatTemplateError, match="arguments must be a mapping"):
        template.render([{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": "{\"x\": 1}"}}]}])
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% if %}")
    with pytest.raises(ValueError, match="list of mappings"):
        template.render("hello")  # type: ignore[arg-type]


def test_environment_matches_transformers_conventions() -> None:
    tpl = ChatTemplate("{{ x | tojson }} {{ bos_token }}|{{ eos_token }}\n{% for i in [1, 2, 3] %}"
                       "{% if i == 2 %}{% continue %}{% endif %}{{ i }}{% endfor %}"
                       "{% generation %}G{% endgeneration %}{{ strftime_now('%Y')|length }}",
                       {"bos_token": None, "eos_token": "E"})
    assert tpl.render([], x={"a": "<é>"}, add_generation_prompt=False) == '{"a": "<é>"} None|E\n13G4'


def test_from_dir(tmp_path: Path) -> None:
    assert ChatTemplate.from_dir(tmp_path) is None
    cfg = {"eos_token": {"content": "<|im_end|>"}, "chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    loaded = ChatTemplate.from_dir(tmp_path)
    assert loaded is not None and loaded.render([]) == "D<|im_end|>"
    (tmp_path / "chat_template.jinja").write_text("J{{ eos_token }}")
    loaded = ChatTemplate.from_dir(tmp_path)
    assert loaded is not None and loaded.render([]) == "J<|im_end|>"


def test_made_tokenizer_dir_ships_template(tmp_path: Path) -> None:
    import importlib.util
    spec = importlib.util.spec_from_file_location("make_tokenizer", ROOT / "tools" / "make_tokenizer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.train_tokenizer(["hello world, bonjour le monde"] * 10, 300, tmp_path)
    loaded = ChatTemplate.from_dir(out)
    assert loaded is not None and loaded.source == TEMPLATE
    assert loaded.special_tokens["eos_token"] == "<|im_end|>" and loaded.special_tokens["bos_token"] is None
