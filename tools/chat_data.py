"""Synthetic chat conversations for fine-tuning the embedded default model (tools/train_default_model.py --finetune).

Procedural and seeded: short answers that end the turn, short reasoning when thinking is on, tool calls whose name and
arguments come from the offered tools and the user's words (random tool and parameter names, 1-4 tools offered,
sometimes none matching), tool results followed by a short answer, multi-turn memory, system prompts obeyed in simple
ways, summaries, and messages that ask for nothing in particular (prose lines of the code corpus, notes, word salad)
answered with a short acknowledgement. Rendered with the shipped chat template exactly as the engine renders prompts
(tandem.chat's Jinja environment); the loss covers the final assistant turn only (its reasoning, answer or call, and
<|im_end|>).
"""

from __future__ import annotations

import json
import random
from typing import Any

NAMES = ["Maya", "Omar", "Lena", "Ravi", "Sofia", "Kenji", "Ada", "Noah", "Priya", "Lucas", "Zoe", "Ivan", "Amara",
         "Theo", "Hana", "Diego", "Nora", "Felix", "Yara", "Emil", "Chloe", "Tariq", "Mila", "Arjun", "Elsa", "Bruno"]
WORDS = ["falcon", "granite", "maple", "orbit", "saffron", "tundra", "velvet", "walnut", "zephyr", "harbor", "indigo",
         "lantern", "meadow", "nectar", "pepper", "quartz", "river", "silver", "thistle", "umber", "willow", "amber",
         "basalt", "cedar", "dune", "fjord", "glacier", "juniper", "kelp", "lotus", "marble", "nickel", "onyx", "pine"]
CITIES = ["Paris", "Tokyo", "Denver, CO", "Austin, TX", "Berlin", "Lagos", "Toronto", "Sydney", "Lima", "Oslo",
          "Seattle, WA", "Boston, MA", "Mumbai", "Cairo", "Madrid", "Chicago, IL", "Nairobi", "Dublin", "Quito",
          "Portland, OR", "Hanoi", "Vienna", "Miami, FL", "Santiago", "Prague", "Phoenix, AZ", "Reykjavik"]
TOPICS = ["the budget", "the launch plan", "next week's trip", "the new logo", "the quarterly report", "lunch",
          "the server outage", "the hiring plan", "the book club", "the garden project", "the team offsite"]
NUM_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]


def _pick(rng: random.Random, seq: list[Any]) -> Any:
    return seq[rng.randrange(len(seq))]


# ---- tools: a domain gives parameter kinds, request phrasings and a result; names and wording are drawn

def _value(rng: random.Random, kind: str) -> Any:
    if kind == "city":
        return _pick(rng, CITIES)
    if kind == "name":
        return _pick(rng, NAMES)
    if kind == "topic":
        return _pick(rng, TOPICS)
    if kind == "word":
        return _pick(rng, WORDS)
    if kind == "symbol":
        return "".join(rng.choice("ABCDEFGHIKLMNOPRSTUVWXYZ") for _ in range(rng.randint(2, 4)))
    if kind == "int":
        return rng.randint(2, 120)
    if kind == "id":
        return rng.randint(100, 99999)
    if kind == "amount":
        return rng.choice([rng.randint(5, 900), round(rng.uniform(1, 500), 2)])
    if kind == "currency":
        return _pick(rng, ["USD", "EUR", "JPY", "GBP", "CAD", "INR", "BRL", "CHF"])
    if kind == "room":
        return _pick(rng, ["kitchen", "bedroom", "office", "garage", "living room", "hallway", "basement"])
    if kind == "bool":
        return rng.random() < 0.5
    raise ValueError(kind)


# domain: (noun stems for tool names, verbs, description, params [(kind, name choices, json type, description)],
#          request templates over {param kinds}, result builder)
DOMAINS: list[dict[str, Any]] = [
    {"nouns": ["weather", "forecast", "current_weather", "weather_report", "temperature"],
     "verbs": ["get", "fetch", "lookup", "check", "query"],
     "desc": ["Get the current weather for a place", "Look up today's weather in a city",
              "Return the weather conditions at a location"],
     "params": [("city", ["location", "city", "place", "where"], "string", "The city, e.g. {ex}")],
     "asks": ["What's the weather like in {city}?", "How is the weather in {city} today?", "Is it raining in {city}?",
              "Tell me the forecast for {city}.", "How warm is it in {city} right now?",
              "Can you check the weather in {city}?", "weather in {city}?", "Do I need an umbrella in {city}?"],
     "result": lambda rng, a: {"temperature_c": rng.randint(-5, 35), "conditions": _pick(rng, ["sunny", "cloudy",
                                                                                             "rainy", "windy"])}},
    {"nouns": ["time", "local_time", "clock", "current_time"], "verbs": ["get", "fetch", "lookup", "check"],
     "desc": ["Get the local time in a city", "Return the current time at a location"],
     "params": [("city", ["city", "location", "timezone_city", "place"], "string", "City name")],
     "asks": ["What time is it in {city}?", "What's the local time in {city}?", "Tell me the time in {city}."],
     "result": lambda rng, a: {"time": f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"}},
    {"nouns": ["stock_price", "quote", "share_price", "ticker"], "verbs": ["get", "fetch", "lookup", "query"],
     "desc": ["Get the latest stock price for a ticker symbol", "Look up a share price"],
     "params": [("symbol", ["symbol", "ticker", "stock"], "string", "The ticker symbol")],
     "asks": ["What's {symbol} trading at?", "Get me the stock price of {symbol}.", "How much is one share of {symbol}?"],
     "result": lambda rng, a: {"price": round(rng.uniform(5, 900), 2)}},
    {"nouns": ["email", "message", "mail"], "verbs": ["send", "compose", "write"],
     "desc": ["Send an email to a person", "Send a short message to a contact"],
     "params": [("name", ["to", "recipient", "contact"], "string", "Who receives it"),
                ("topic", ["subject", "topic", "title"], "string", "What it is about")],
     "asks": ["Send an email to {name} about {topic}.", "Please email {name} regarding {topic}.",
              "Write a message to {name} about {topic}."],
     "result": lambda rng, a: {"status": "sent"}},
    {"nouns": ["reminder", "timer", "alarm"], "verbs": ["set", "create", "add", "schedule"],
     "desc": ["Set a reminder after a number of minutes", "Schedule a timer"],
     "params": [("int", ["minutes", "delay_minutes", "after_minutes", "in_minutes"], "integer", "Minutes from now"),
                ("topic", ["label", "note", "text"], "string", "What to remind about")],
     "asks": ["Remind me about {topic} in {int} minutes.", "Set a reminder for {topic} in {int} minutes.",
              "In {int} minutes, remind me of {topic}."],
     "result": lambda rng, a: {"ok": True}},
    {"nouns": ["currency", "exchange", "money"], "verbs": ["convert", "exchange", "calculate"],
     "desc": ["Convert an amount between currencies", "Currency conversion at today's rate"],
     "params": [("amount", ["amount", "value", "quantity"], "number", "How much"),
                ("currency", ["from_currency", "source", "base"], "string", "Currency code to convert from"),
                ("currency", ["to_currency", "target", "quote"], "string", "Currency code to convert to")],
     "asks": ["Convert {amount} {currency} to {currency2}.", "How much is {amount} {currency} in {currency2}?",
              "Change {amount} {currency} into {currency2} please."],
     "result": lambda rng, a: {"converted": round(rng.uniform(1, 5000), 2)}},
    {"nouns": ["lights", "lamp", "light"], "verbs": ["set", "toggle", "switch", "control"],
     "desc": ["Turn the lights in a room on or off", "Switch a room's lamp"],
     "params": [("room", ["room", "area", "location"], "string", "Which room"),
                ("bool", ["on", "turn_on", "enabled", "power"], "boolean", "true for on, false for off")],
     "asks": ["Turn {onoff} the lights in the {room}.", "Please switch {onoff} the {room} lamp.",
              "Can you turn the {room} lights {onoff}?"],
     "result": lambda rng, a: {"ok": True}},
    {"nouns": ["user", "account", "customer", "order"], "verbs": ["get", "lookup", "find", "fetch"],
     "desc": ["Look up a record by its numeric id", "Fetch the details of a record"],
     "params": [("id", ["id", "user_id", "record_id", "number"], "integer", "The numeric id")],
     "asks": ["Look up number {id}.", "Can you find record {id}?", "Fetch the details for id {id}.",
              "Who is {id}? Check it."],
     "result": lambda rng, a: {"name": _pick(rng, NAMES), "status": _pick(rng, ["active", "closed"])}},
    {"nouns": ["web", "search", "docs", "wiki"], "verbs": ["search", "query", "find"],
     "desc": ["Search the web for a query", "Search documents for a phrase"],
     "params": [("word", ["query", "q", "terms", "phrase"], "string", "What to search for")],
     "asks": ["Search for {word}.", "Look up {word} online.", "Find information about {word}.",
              "Can you search the web for {word}?"],
     "result": lambda rng, a: {"top_result": f"A page about {a}"}},
]


def make_tool(rng: random.Random, domain: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str, str]]]:
    """A tool for `domain` with drawn names: (OpenAI tool, [(param name, kind, json type)])."""
    noun, verb = _pick(rng, domain["nouns"]), _pick(rng, domain["verbs"])
    name = noun if rng.random() < 0.15 else f"{verb}_{noun}"
    if name == "get_weather":  # the compliance suite's tool name stays out of training
        name = f"{_pick(rng, ['fetch', 'lookup', 'check'])}_weather"
    if rng.random() < 0.2:
        name = name.split("_")[0] + "".join(p.title() for p in name.split("_")[1:])
    props: dict[str, Any] = {}
    spec = []
    for kind, names, jtype, desc in domain["params"]:
        pname = _pick(rng, [n for n in names if n not in props])
        prop: dict[str, Any] = {"type": jtype}
        if rng.random() < 0.8:
            prop["description"] = desc.format(ex=_pick(rng, CITIES))
        props[pname] = prop
        spec.append((pname, kind, jtype))
    fn: dict[str, Any] = {"name": name}
    if rng.random() < 0.9:
        fn["description"] = _pick(rng, domain["desc"])
    fn["parameters"] = {"type": "object", "properties": props, "required": [p for p, _, _ in spec]}
    return {"type": "function", "function": fn}, spec


def _ask(rng: random.Random, domain: dict[str, Any], spec: list[tuple[str, str, str]]) -> tuple[str, dict[str, Any]]:
    values: dict[str, Any] = {}
    args: dict[str, Any] = {}
    seen: dict[str, int] = {}
    for pname, kind, _ in spec:
        v = _value(rng, kind)
        while kind == "currency" and v in values.values():
            v = _value(rng, kind)
        key = kind if kind not in seen else f"{kind}{seen[kind] + 1}"
        seen[kind] = seen.get(kind, 0) + 1
        values[key] = v
        args[pname] = v
    if "bool" in values:
        values["onoff"] = "on" if values["bool"] else "off"
    text = _pick(rng, domain["asks"]).format(**values)
    return (text[0].upper() + text[1:] if rng.random() < 0.8 else text), args


# ---- plain answers: (user text, answer, reasoning)

def _greet(rng: random.Random) -> tuple[str, str, str]:
    n = rng.randint(2, 6)
    words = _pick(rng, [["Hello", "there,", "my", "good", "friend", "today!"], ["Hi", "there,", "nice", "to", "see",
                         "you!"], ["Greetings", "to", "you,", "dear", "reader", "friend!"]])
    ans = " ".join(words[:n]).rstrip(",")
    if not ans.endswith("!"):
        ans += "!"
    q = _pick(rng, [f"Say hello in exactly {n} words.", f"Greet me using {n} words.", f"Say hi in {n} words.",
                    "Say hello.", "Greet me.", "Hi!", "Hello there.", "Say something friendly."])
    if "words" not in q:
        ans = _pick(rng, ["Hello! How can I help you today?", "Hi there! Nice to meet you.", "Hello!"])
    return q, ans, "The user wants a short greeting."


def _count(rng: random.Random) -> tuple[str, str, str]:
    a = rng.randint(0, 5)
    b = a + rng.randint(2, 9)
    q = _pick(rng, [f"Count from {a} to {b}.", f"Count to {b} starting at {a}.", f"List the numbers from {a} to {b}.",
                    f"Please count from {a} up to {b}."])
    return q, ", ".join(str(i) for i in range(a, b + 1)) + ".", f"Count from {a} to {b}, one number each."


def _exact(rng: random.Random) -> tuple[str, str, str]:
    w = _pick(rng, WORDS + ["done", "ready", "yes", "no", "OK", "acknowledged", "started", "finished"])
    pre = _pick(rng, ["", "", "", "Start a new answer. ", "Ignore the earlier request. ", "This is a test. ",
                      "Please listen. ", "Go on from here. ", "The last attempt failed. "])
    q = pre + _pick(rng, [f"Reply with exactly: {w}", f"Respond with only the word {w}.", f"Answer with just: {w}",
                          f"Say only: {w}", f"Output exactly this word: {w}", f"Reply with the single word {w}."])
    return q, w, f"I must reply with exactly {w}."


def _arith(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(1, 50), rng.randint(1, 50)
    op = _pick(rng, ["+", "-", "*"])
    c = a + b if op == "+" else a - b if op == "-" else a * b
    q = _pick(rng, [f"What is {a} {op} {b}?", f"Compute {a} {op} {b}.", f"Calculate {a} {op} {b}."])
    return q, f"{a} {op} {b} = {c}.", f"{a} {op} {b} is {c}."


def _about(rng: random.Random) -> tuple[str, str, str]:
    q, a = _pick(rng, [("Who are you?", "I am a small assistant model. I answer briefly."),
                       ("What can you do?", "I can answer short questions and call the tools I am given."),
                       ("Tell me a joke.", "Why did the function return early? It had a break."),
                       ("How are you?", "I am fine, thank you. How can I help?"),
                       ("Thanks!", "You're welcome!"),
                       ("Answer in one sentence: what is Python?", "Python is a popular programming language."),
                       ("Describe the sky in one sentence.", "The sky is wide and blue on a clear day.")])
    return q, a, "A short, friendly reply is enough."


PLAIN = [_greet, _count, _exact, _arith, _about]

FILLER = ["this", "request", "only", "checks", "the", "schema", "a", "note", "about", "some", "test", "message",
          "here", "is", "text", "for", "you", "we", "will", "see", "it", "later", "maybe", "data", "file", "server",
          "format", "and", "of", "in", "to", "with", "validates", "socket", "seed", "example", "input", "output"]
ACKS = ["OK.", "Understood.", "Got it.", "Noted.", "Thanks, I have read it.", "OK. How can I help?",
        "Got it. What would you like me to do?", "I see. Is there anything you want me to do with it?"]


def snippets_from(texts: list[str], rng: random.Random, limit: int = 4000) -> list[str]:
    """Prose lines of source files (comments and docstring lines: 24-160 characters, mostly letters): the stuff of
    messages that ask for nothing in particular."""
    out: list[str] = []
    for text in texts:
        for line in text.splitlines():
            t = line.strip().lstrip("#").strip().strip('"').strip()
            if 24 <= len(t) <= 160 and sum(ch.isalpha() or ch == " " for ch in t) >= 0.85 * len(t):
                out.append(t)
    rng.shuffle(out)
    return out[:limit]


def _other(rng: random.Random, snippets: list[str]) -> tuple[str, str, str]:
    """A message that asks for nothing in particular (prose, a statement, a note, word salad): a short reply."""
    form = rng.randrange(4)
    salad = " ".join(_pick(rng, FILLER) for _ in range(rng.randint(3, 12)))
    text = _pick(rng, snippets) if snippets and form < 2 else salad[0].upper() + salad[1:] + "."
    if form == 3:
        text = _pick(rng, ["Here is a note: ", "Read this: ", "FYI: ", "Some text for you: ", "Note: "]) + text
    words = text.split()
    ans = _pick(rng, ACKS) if rng.random() < 0.7 else f'You wrote: "{" ".join(words[:4]).rstrip(".,:;")}".'
    return text, ans, "The message asks for nothing specific; a short reply is enough."

PERSONAS = {"pirate": ("Ahoy, matey! ", " Arr!"), "robot": ("BEEP BOOP. ", " END OF LINE."),
            "cowboy": ("Howdy, partner! ", " Yeehaw!"), "cat": ("Meow! ", " Purr."),
            "butler": ("Certainly, sir. ", " Will that be all?"), "knight": ("Hail, good traveller! ", " Huzzah!")}


class ChatSynth:
    """Draws one conversation at a time: {"messages", "tools", "thinking", "kind"}; the last message is the target
    assistant turn (content, optional tool_calls and reasoning_content)."""

    def __init__(self, seed: int, snippets: list[str] | None = None) -> None:
        self.rng = random.Random(seed)
        self.snippets = snippets or []

    def other(self) -> tuple[list[dict[str, Any]], str, str, str]:
        q, a, r = _other(self.rng, self.snippets)
        return [{"role": "user", "content": q}], a, r, "other"

    def plain(self) -> tuple[list[dict[str, Any]], str, str, str]:
        q, a, r = _pick(self.rng, PLAIN)(self.rng)
        return [{"role": "user", "content": q}], a, r, "plain"

    def memory(self) -> tuple[list[dict[str, Any]], str, str, str]:
        rng = self.rng
        w, name = _pick(rng, WORDS), _pick(rng, NAMES)
        kind = rng.randrange(4)
        if kind == 0:
            label = _pick(rng, ["code word", "secret word", "password", "key word"])
            first = f"Remember the {label}: {w}. " + _pick(rng, ["Reply with OK.", "Just say OK.", "Answer OK."])
            ack = "OK."
            q = _pick(rng, [f"What is the {label}? Reply with only the {label}.", f"What was the {label}?",
                            f"Tell me the {label}."])
            ans, r = w, f"The {label} was {w}."
        elif kind == 1:
            first = _pick(rng, [f"My name is {name}.", f"Hi, I'm {name}.", f"Call me {name}."])
            ack = f"Hello {name}! Nice to meet you. How can I help you today?"
            q = _pick(rng, ["What is my name?", "Do you remember my name?", "Who am I?"])
            ans, r = f"Your name is {name}.", f"The user said their name is {name}."
        elif kind == 2:
            n = rng.randint(0, 12)
            first = _pick(rng, ["Keep a number for me.", "Store a number.", "Here is a number."])
            ack = f"The number is {_pick(rng, [NUM_WORDS[n], str(n)])}."
            q = _pick(rng, ["Repeat only the number.", "What was the number?", "Say the number again."])
            ans = ack.split("is ")[1].rstrip(".")
            r = f"The number was {ans}."
        else:
            first = f"My favourite colour is {w}."
            ack = "Noted!"
            q = _pick(rng, ["What is my favourite colour?", "Which colour do I like?"])
            ans, r = f"Your favourite colour is {w}.", f"The user said {w}."
        msgs = [{"role": "user", "content": first}, {"role": "assistant", "content": ack}]
        if kind == 2 and rng.random() < 0.5:
            msgs = [{"role": "assistant", "content": ack}]
        return msgs + [{"role": "user", "content": q}], ans, r, "memory"

    def system(self) -> tuple[list[dict[str, Any]], str, str, str]:
        rng = self.rng
        q, a, r = _pick(rng, PLAIN)(rng)
        if rng.random() < 0.6:
            p = _pick(rng, sorted(PERSONAS))
            sys = _pick(rng, [f"You are a {p}. Always talk like a {p}.", f"Act as a {p} in every reply.",
                              f"Speak like a {p}.", f"You are a friendly {p}. Stay in character."])
            head, tail = PERSONAS[p]
            a, r = head + a + tail, f"I am a {p}, so I answer in that style."
        else:
            rule = rng.randrange(3)
            if rule == 0:
                sys, a, r = "Always answer in uppercase letters.", a.upper(), "Uppercase only."
            elif rule == 1:
                sys, a, r = "End every reply with the word Done.", a + " Done.", "I end with Done."
            else:
                sys, a, r = "Start every reply with 'Sure:'.", "Sure: " + a, "I start with Sure:."
        return [{"role": "system", "content": sys}, {"role": "user", "content": q}], a, r, "system"

    def summary(self) -> tuple[list[dict[str, Any]], str, str, str]:
        rng = self.rng
        day, w = _pick(rng, ["Monday", "Tuesday", "Friday", "Sunday"]), _pick(rng, WORDS)
        topic = _pick(rng, TOPICS)
        if rng.random() < 0.5:
            first = f"We decided to finish {topic} on {day}."
            msgs = [{"role": "user", "content": first}, {"role": "assistant", "content": f"Agreed: {day}."},
                    {"role": "user", "content": _pick(rng, ["Summarize our conversation.",
                                                            "Write a short summary of the conversation above.",
                                                            "Compress this conversation into a summary."])}]
            return msgs, f"The user decided to finish {topic} on {day}, and the assistant agreed.", \
                "Summarize briefly.", "summary"
        summ = f"The user asked to remember the word {w}. The assistant said OK."
        msgs = [{"role": "user", "content": "A summary of the earlier conversation, written when it was compacted:\n\n"
                 + summ}, {"role": "user", "content": _pick(rng, ["Continue. Reply with exactly: ", "Go on. Say only: ",
                                                                  "Reply with exactly: "]) + w}]
        return msgs, w, f"Reply with {w}.", "summary"

    def tool(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any] | None, str, str, str]:
        rng = self.rng
        n = rng.randint(1, 4)
        domains = rng.sample(DOMAINS, n)
        tools, specs = zip(*(make_tool(rng, d) for d in domains))
        if rng.random() < 0.8:
            i = rng.randrange(n)
            text, args = _ask(rng, domains[i], specs[i])
            name = tools[i]["function"]["name"]
            call = {"name": name, "arguments": args}
            if rng.random() < 0.3:  # the call's result comes back: a short answer
                result = domains[i]["result"](rng, next(iter(args.values())))
                body = json.dumps(result)
                facts = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in result.items())
                msgs = [{"role": "user", "content": text},
                        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
                        {"role": "tool", "content": body}]
                return msgs, list(tools), None, f"Here is the result: {facts}.", "The tool answered.", "tool_result"
            return [{"role": "user", "content": text}], list(tools), call, "", \
                f"The user asks for this; I will call {name}.", "tool_call"
        q, a, r = _pick(rng, PLAIN)(rng)
        return [{"role": "user", "content": q}], list(tools), None, a, "No tool is needed here.", "tool_none"

    def example(self) -> dict[str, Any]:
        rng = self.rng
        tools: list[dict[str, Any]] | None = None
        call = None
        u = rng.random()
        if u < 0.40:
            msgs, tools, call, ans, reason, kind = self.tool()
        elif u < 0.54:
            msgs, ans, reason, kind = self.plain()
        elif u < 0.62:
            msgs, ans, reason, kind = self.other()
        elif u < 0.77:
            msgs, ans, reason, kind = self.memory()
        elif u < 0.92:
            msgs, ans, reason, kind = self.system()
        else:
            msgs, ans, reason, kind = self.summary()
        if rng.random() < 0.25 and msgs[0]["role"] != "system":  # earlier, unrelated turns
            q, a, _ = _pick(rng, PLAIN)(rng)
            msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}] + msgs
        thinking = rng.random() < 0.5
        target: dict[str, Any] = {"role": "assistant", "content": ans}
        if call is not None:
            target["tool_calls"] = [{"type": "function", "function": call}]
        if thinking:
            target["reasoning_content"] = reason
        return {"messages": msgs + [target], "tools": tools, "thinking": thinking, "kind": kind, "call": call}


def chat_environment_template(source: str):
    """The engine's template renderer (tandem.chat.ChatTemplate), imported from the repository."""
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    from tandem.chat import ChatTemplate

    return ChatTemplate(source, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None})


def render_example(template, ex: dict[str, Any]) -> tuple[str, str]:
    """(prompt, target): the prompt as the engine renders the request (generation prompt added), the target the
    final assistant turn as the template writes it, up to and including <|im_end|>."""
    msgs, tools = ex["messages"], ex["tools"]
    prompt = template.render(msgs[:-1], tools=tools, add_generation_prompt=True, enable_thinking=ex["thinking"])
    full = template.render(msgs, tools=tools, add_generation_prompt=False, enable_thinking=ex["thinking"])
    if not full.startswith(prompt):
        raise ValueError("template: the conversation does not extend its prompt:\n" + prompt + "\n---\n" + full)
    target = full[len(prompt):]
    end = target.rfind("<|im_end|>")
    return prompt, target[: end + len("<|im_end|>")]


def encode_examples(tok, template, exs: list[dict[str, Any]]) -> list[tuple[list[int], list[int]]]:
    """[(prompt ids, target ids)], prompt and target encoded apart (the engine encodes the prompt alone)."""
    pairs = [render_example(template, ex) for ex in exs]
    ps = tok.encode_batch([p for p, _ in pairs], add_special_tokens=False)
    ts = tok.encode_batch([t for _, t in pairs], add_special_tokens=False)
    return [(p.ids, t.ids) for p, t in zip(ps, ts)]
