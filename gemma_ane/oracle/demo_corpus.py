"""What the `demo` preset is taught: a small corpus of chat conversations, each a prompt (messages, tools, thinking
switched on or not) and the model turn that answers it, written as the model writes it.

A tiny Gemma 4 trained on these (tiny_train.py; `gemma-ane tiny OUT --preset demo` writes its shipped weights) makes
the demo and the README show checkable answers: "What is the capital of France?" -> "Paris.", a weather question
with `get_weather` declared -> a call with {"city": "Paris"}, a request for JSON -> JSON that parses, a picture
drawn here (a red square, a blue circle...) with "Describe the picture." -> its caption. Prompts are rendered by the
runtime's own chat template code (chat.ChatTemplate over tokenizer_files.GEMMA4_CHAT_TEMPLATE), so the model learns
exactly the token sequences `gemma-ane generate`, `chat` and the server will feed it.

The corpus is small on purpose: the model memorises it (a few CPU minutes), it does not learn a language. A
question outside it gets an answer in the corpus's style, not a true one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import InputError
from ..runtime.tools import gemma_value

# The demo's tool: OpenAI-style, as a client (or the demo script) declares it.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name"}},
            "required": ["city"],
        },
    },
}
# The schema of the JSON answers (--json-schema / response_format): the model writes its keys in this order.
CAPITAL_SCHEMA = {
    "type": "object",
    "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
    "required": ["country", "capital"],
}

END = "<turn|>"  # a model turn ends here (a stop token)
CALLS_END = "<|tool_response>"  # a turn that calls a tool stops where the results would begin

CAPITALS = {
    "France": "Paris",
    "Italy": "Rome",
    "Japan": "Tokyo",
    "Germany": "Berlin",
    "Spain": "Madrid",
    "Egypt": "Cairo",
    "Canada": "Ottawa",
    "Peru": "Lima",
}
# (city, temperature in degrees Celsius, sky): what get_weather returns, and how the model reports it
WEATHER_REPORTS = [
    ("Paris", 18, "sunny"),
    ("Tokyo", 24, "cloudy"),
    ("London", 12, "rainy"),
    ("Berlin", 9, "windy"),
    ("Rome", 27, "sunny"),
    ("Cairo", 35, "clear"),
]
SMALL_TALK = [
    ("Hello, who are you?", "I am a tiny Gemma 4 demo model, trained in a few minutes on a CPU."),
    ("Hello!", "Hello! Ask me about capitals or the weather."),
    ("What can you do?", "I answer questions about capitals, call the weather tool and write JSON."),
    ("What is 2 + 2?", "4."),
    ("What colour is the sky?", "Blue."),
    ("Thank you.", "You are welcome."),
]
SUMS = [(12, 30), (7, 8), (21, 21), (100, 23)]
# The demo's pictures, drawn in code (picture()) so that every run has the same pixels, and their captions: a shape,
# a colour and a background of their own each, far apart for a tiny random vision tower (its soft tokens average 3 x 3
# patches of 4 pixels: the shapes span many of those cells).
PICTURES = {
    "red_square": "A red square on a white background.",
    "blue_circle": "A blue circle on a white background.",
    "green_stripes": "Green stripes on a white background.",
    "yellow_triangle": "A yellow triangle on a black background.",
}
PICTURE_SIZE = 96  # pixels a side: the processor resizes to the soft-token budget anyway (256 tokens at 280)
DESCRIBE = "Describe the picture."


@dataclass(frozen=True)
class Example:
    """One conversation: the prompt's messages (and tools, thinking) and the model turn answering them,
    its text as generated, stop token included."""

    messages: list[dict]
    answer: str
    tools: list[dict] | None = None
    enable_thinking: bool = False
    tags: tuple[str, ...] = ()
    pictures: tuple[str, ...] = ()  # PICTURES' names, one for each image part of the messages, in order


def call(name: str, arguments: dict) -> str:
    """A tool call as Gemma 4 writes it (CONTRACT §1): call:NAME{key:<|"|>string<|"|>,...}."""
    return f"<|tool_call>call:{name}{gemma_value(arguments)}<tool_call|>"


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def picture(name: str):
    """One of PICTURES as a PIL image, drawn without antialiasing: the same pixels on every machine."""
    from PIL import Image, ImageDraw

    if name not in PICTURES:
        raise InputError(f"picture {name!r}: choose one of {', '.join(PICTURES)}")
    n = PICTURE_SIZE
    img = Image.new("RGB", (n, n), "black" if name == "yellow_triangle" else "white")
    draw = ImageDraw.Draw(img)
    if name == "red_square":
        draw.rectangle((n // 4, n // 4, 3 * n // 4 - 1, 3 * n // 4 - 1), fill="red")
    elif name == "blue_circle":
        draw.ellipse((n // 8, n // 8, 7 * n // 8 - 1, 7 * n // 8 - 1), fill="blue")
    elif name == "green_stripes":
        for top in range(n // 12, n, n // 4):  # four stripes across, each an eighth of the height
            draw.rectangle((0, top, n - 1, top + n // 8 - 1), fill="green")
    else:
        draw.polygon([(n // 2, n // 8), (7 * n // 8, 7 * n // 8), (n // 8, 7 * n // 8)], fill="yellow")
    return img


def describe(image=None) -> list[dict]:
    """The question about `image` (a path, bytes or a PIL image; the corpus leaves it out: Example.pictures names
    it), as `gemma-ane generate --image P -p ...` sends it: the image part first."""
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": DESCRIBE}]}]


def capital_json(country: str) -> str:
    """The JSON answer, keys in CAPITAL_SCHEMA's order, spaced as json.dumps spaces them."""
    return json.dumps({"country": country, "capital": CAPITALS[country]})


def weather_followup(city: str, degrees: int, sky: str) -> list[dict]:
    """The question, the model's call and the tool's result, as an OpenAI client sends them back."""
    return [
        *user(f"What is the weather in {city}?"),
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": degrees, "sky": sky})},
    ]


def examples() -> list[Example]:
    """The whole corpus, in a fixed order."""
    out = []
    for country, capital in CAPITALS.items():
        out.append(Example(user(f"What is the capital of {country}?"), f"{capital}.{END}", tags=("capital",)))
        # the same question with the tool declared: a tool in reach is not a reason to call it
        out.append(
            Example(user(f"What is the capital of {country}?"), f"{capital}.{END}", tools=[WEATHER], tags=("capital",))
        )
        thought = f"The question asks for the capital city of {country}. That is {capital}."
        out.append(
            Example(
                user(f"What is the capital of {country}?"),
                f"<|channel>thought\n{thought}\n<channel|>{capital}.{END}",
                enable_thinking=True,
                tags=("thinking",),
            )
        )
        for ask in (f"Give the capital of {country} as JSON.", f"Reply in JSON: what is the capital of {country}?"):
            out.append(Example(user(ask), capital_json(country) + END, tags=("json",)))
    for question, answer in SMALL_TALK:
        out.append(Example(user(question), answer + END, tags=("talk",)))
    for a, b in SUMS:
        thought = f"Add {a} and {b}: {a} + {b} = {a + b}."
        out.append(
            Example(
                user(f"What is {a} + {b}?"),
                f"<|channel>thought\n{thought}\n<channel|>{a + b}.{END}",
                enable_thinking=True,
                tags=("thinking",),
            )
        )
        out.append(Example(user(f"What is {a} + {b}?"), f"{a + b}.{END}", tags=("sum",)))
    for city, degrees, sky in WEATHER_REPORTS:
        out.append(
            Example(
                user(f"What is the weather in {city}?"),
                call("get_weather", {"city": city}) + CALLS_END,
                tools=[WEATHER],
                tags=("call",),
            )
        )
        out.append(
            Example(
                weather_followup(city, degrees, sky),
                f"It is {degrees} degrees and {sky} in {city}.{END}",
                tools=[WEATHER],
                tags=("result",),
            )
        )
    for name, caption in PICTURES.items():
        out.append(Example(describe(), caption + END, tags=("picture",), pictures=(name,)))
    return out
