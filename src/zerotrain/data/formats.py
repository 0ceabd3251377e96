"""The common fine-tuning data formats, read as the records the data path knows (jsonl.py: text, prompt/completion,
messages): ShareGPT and Alpaca records, JSON Lines compressed with gzip or zstd, a Hugging Face `datasets` folder
written by `save_to_disk`, and a folder of Parquet shards.

    {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}   ShareGPT: a chat
    {"instruction": ..., "input": ..., "output": ...}                          Alpaca: a user turn and the reply

Both become {"messages": [...]} and are rendered with the model's chat template like any chat, so the same
conversation prepares to the same bytes in every format. ShareGPT's roles: human/user -> user, gpt/assistant ->
assistant, system -> system (entries may also be {"role", "content"}); a turn's "weight" (axolotl's: 0, a turn kept
as context and not trained; 1, the default) goes with it, and any other key of a turn is refused naming it, as a
message's is; an optional "system" field is a first system turn. Tool turns as LLaMA-Factory writes them: a
function_call (or tool_call) turn's value is the JSON of a call {"name", "arguments"} (or a list of them), an
assistant turn with those tool_calls; an observation (tool, function, ipython) turn's value is a tool's result, a
`tool` message; the "tools" field (a list of function schemas, or its JSON string) goes to the template as the
record's tools, a bare schema {"name", "parameters", ...} wrapped as {"type": "function", "function": ...} (what
transformers passes). Alpaca's user turn
is the instruction, then a blank line and the input when the input is not empty; an optional "system" is a first
system turn and LLaMA-Factory's "history" ([[user, assistant], ...]) the turns before.

Files and folders: `.jsonl.gz` through the standard library, `.jsonl.zst` through the `zstandard` package (the
`zstd` extra); a `save_to_disk` folder's data files are Arrow IPC streams (state.json lists them), read with pyarrow
(the `parquet` extra) without the `datasets` library; a folder of Parquet shards is read file by file, sorted by
path, of its train split where its files name splits as a hub download does (`data/train-00000-of-00002.parquet`).
A record of a folder is named by its file and row, file[i].
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re

from zerotrain.errors import ConfigError

from .chat import WEIGHT, list_of_objects

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "observation": "tool", "tool": "tool", "function": "tool", "ipython": "tool"}
CALL_ROLES = ("function_call", "tool_call")  # an assistant turn that calls tools: its value is the calls' JSON
# A table's record columns, the first shape found: (the columns that make the shape, the optional ones read with them).
SHAPES = ((("messages",), ("tools", "documents")), (("text",), ()),
          (("prompt", "completion"), ("tools", "documents")), (("conversations",), ("system", "tools")),
          (("instruction", "output"), ("input", "system", "history")))
COMPRESSED = {".gz": "gzip", ".zst": "zstd"}
RECORD_NAMES = (".jsonl",)  # what a compressed file holds: JSON Lines, read a line at a time
STATE, DATASET_DICT = "state.json", "dataset_dict.json"  # what save_to_disk writes beside a data set's Arrow files
SHARD_SPLIT = re.compile(r"^(?P<split>[A-Za-z0-9_.]+?)-\d{5}-of-\d{5}\.parquet$")  # the hub's file names
SPLIT_FOLDERS = ("train", "test", "validation", "valid", "dev", "eval")


# --- records -------------------------------------------------------------------------------------------------------


def is_sharegpt(record: dict) -> bool:
    return "conversations" in record


def is_alpaca(record: dict) -> bool:
    return "instruction" in record and "output" in record


def as_messages(record: dict, where: str) -> dict | None:
    """{"messages": [...]} of a ShareGPT or Alpaca record, None for any other; ConfigError naming `where` for a value
    that is not what the format says."""
    if is_sharegpt(record):
        tools = _sharegpt_tools(record.get("tools"), where)
        return {"messages": _sharegpt(record, where), **({"tools": tools} if tools else {})}
    if is_alpaca(record):
        return {"messages": _alpaca(record, where)}
    return None


def _string(value, what: str, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {what} is {value!r}, not a string")
    return value


def _system(record: dict, where: str) -> list[dict]:
    system = record.get("system")
    return [] if system in (None, "") else [{"role": "system", "content": _string(system, '"system"', where)}]


def _sharegpt(record: dict, where: str) -> list[dict]:
    turns = record["conversations"]
    if not isinstance(turns, list) or not turns:
        raise ConfigError(f"{where}: \"conversations\" is {turns!r}, not a list of {{\"from\", \"value\"}} objects")
    messages = _system(record, where)
    for k, turn in enumerate(turns):
        keys = ("from", "value") if isinstance(turn, dict) and "from" in turn else ("role", "content")
        if not isinstance(turn, dict) or any(key not in turn for key in keys):
            raise ConfigError(f"{where}: conversations[{k}] is {turn!r}, not an object with \"from\" and \"value\"")
        unknown = [key for key in turn if key not in (*keys, WEIGHT)]
        if unknown:
            raise ConfigError(f"{where}: conversations[{k}] has the key {unknown[0]!r}, which a ShareGPT turn does not "
                              f"have (a turn's keys: {', '.join((*keys, WEIGHT))}): leave it out")
        weight = {WEIGHT: turn[WEIGHT]} if WEIGHT in turn else {}  # checked with the messages (chat.check_messages)
        role = turn[keys[0]]
        if role in CALL_ROLES:
            value = _string(turn[keys[1]], f"conversations[{k}] ({role}) \"{keys[1]}\"", where)
            messages.append({"role": "assistant", "content": "", "tool_calls": _calls(value, k, role, where),
                             **weight})
            continue
        if role not in SHAREGPT_ROLES:
            raise ConfigError(f"{where}: conversations[{k}] has role {role!r}; a ShareGPT role is one of "
                              f"{', '.join([*SHAREGPT_ROLES, *CALL_ROLES])}")
        if SHAREGPT_ROLES[role] == "system" and messages and k == 0:
            raise ConfigError(f"{where}: has both a \"system\" field and a first system turn")
        content = _string(turn[keys[1]], f"conversations[{k}] ({role}) \"{keys[1]}\"", where)
        messages.append({"role": SHAREGPT_ROLES[role], "content": content, **weight})
    return messages


def _calls(value: str, k: int, role: str, where: str) -> list[dict]:
    """A function_call turn's value, {"name", "arguments"} or a list of them in JSON, as OpenAI-style tool_calls (the
    arguments an object: a JSON string of one is read)."""
    try:
        calls = json.loads(value)
    except json.JSONDecodeError:
        calls = None
    calls = [calls] if isinstance(calls, dict) else calls
    if not isinstance(calls, list) or not calls or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        raise ConfigError(f"{where}: conversations[{k}] ({role}) has the value {value[:80]!r}, not the JSON of a call "
                          "{\"name\": ..., \"arguments\": {...}} or a list of them")
    out = []
    for c in calls:
        arguments = c.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass  # kept as written: a template writes a string as it is
        out.append({"type": "function", "function": {"name": c["name"], "arguments": arguments}})
    return out


def _sharegpt_tools(tools, where: str) -> list[dict]:
    """A ShareGPT record's "tools" (a list of function schemas, or its JSON string) as transformers passes tools to a
    template: each {"type": "function", "function": schema}."""
    if tools in (None, ""):
        return []
    return [t if "function" in t or "name" not in t else {"type": "function", "function": t}
            for t in list_of_objects(tools, "tools", where)]


def _alpaca(record: dict, where: str) -> list[dict]:
    instruction = _string(record["instruction"], '"instruction"', where)
    output = _string(record["output"], '"output"', where)
    given = record.get("input")
    given = "" if given is None else _string(given, '"input"', where)
    history = record.get("history") or []
    if not isinstance(history, list) or not all(
            isinstance(h, (list, tuple)) and len(h) == 2 and all(isinstance(s, str) for s in h) for h in history):
        raise ConfigError(f"{where}: \"history\" is {history!r}, not a list of [user, assistant] string pairs")
    messages = _system(record, where)
    for user, assistant in history:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return messages + [{"role": "user", "content": alpaca_user(instruction, given)},
                       {"role": "assistant", "content": output}]


def alpaca_user(instruction: str, given: str) -> str:
    """An Alpaca record's user turn: the instruction, then a blank line and the input when there is one (the layout of
    Alpaca's own prompt, less its preamble: the chat template frames the turn)."""
    return f"{instruction}\n\n{given}" if given else instruction


def table_record(record: dict) -> dict:
    """A row of a table (Parquet, Arrow) as the record JSON Lines would hold: a table gives every message (every
    ShareGPT turn) each key any message of the column has, null where it has none, so keys that are null are a
    message's absent keys."""
    for column in ("messages", "conversations", "prompt", "completion"):
        turns = record.get(column)
        if isinstance(turns, list):
            record = {**record, column: [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
                                         for m in turns]}
    return record


def shape_columns(names: list[str]) -> list[str] | None:
    """The columns of a table (Parquet, Arrow) that its records are read from: the first shape of SHAPES it has, with
    that shape's optional columns it has; None if it has none."""
    for needed, optional in SHAPES:
        if all(n in names for n in needed):
            return [*needed, *(n for n in optional if n in names)]
    return None


# --- compressed JSON Lines -----------------------------------------------------------------------------------------


def compression(path: str) -> str | None:
    """"gzip" or "zstd" for a compressed file of records (.jsonl.gz, .jsonl.zst), None otherwise."""
    stem, ext = os.path.splitext(path.lower())
    return COMPRESSED.get(ext) if stem.endswith(RECORD_NAMES) else None


def inner_name(path: str) -> str:
    """The name of the file a compressed file holds (data.jsonl for data.jsonl.gz); `path` itself otherwise."""
    return os.path.splitext(path)[0] if compression(path) else path


def open_records_file(path: str):
    """(the file as opened, a binary stream of its decompressed bytes): the first's position is what was read of the
    file, for a progress bar. ConfigError naming the extra when zstandard is missing."""
    raw = open(path, "rb")
    kind = compression(path)
    if kind is None:
        return raw, raw
    if kind == "gzip":
        import gzip
        return raw, gzip.GzipFile(fileobj=raw, mode="rb")
    try:
        import zstandard
    except ImportError:
        raw.close()
        raise ConfigError(f"{path}: zstd is read through the zstandard package, which is not installed: pip install "
                          "'zerotrain[zstd]', or give it decompressed (zstd -d) or as .jsonl.gz") from None
    return raw, io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))


def decompression_errors() -> tuple[type[BaseException], ...]:
    """What a damaged gzip or zstd stream raises while it is read."""
    import gzip
    import zlib
    errors: tuple = (gzip.BadGzipFile, EOFError, zlib.error)
    try:
        import zstandard
        errors += (zstandard.ZstdError,)
    except ImportError:
        pass
    return errors


# --- folders: save_to_disk and Parquet shards ----------------------------------------------------------------------


def is_records_folder(path: str) -> bool:
    """Whether `path` is a folder `datasets`' save_to_disk wrote (a data set or a DatasetDict) or one holding Parquet
    files (a hub download's layout)."""
    if not os.path.isdir(path):
        return False
    if os.path.isfile(os.path.join(path, DATASET_DICT)):
        return True
    if os.path.isfile(os.path.join(path, STATE)) and (any(n.endswith(".arrow") for n in os.listdir(path))
                                                       or _lists_data_files(os.path.join(path, STATE))):
        return True  # a save_to_disk folder, its data files there or not (folder_files names a missing one)
    return bool(_parquet_files(path))


def _lists_data_files(state: str) -> bool:
    """Whether `state` is a save_to_disk state.json (it lists the data files), whatever else it is otherwise."""
    try:
        return "_data_files" in _json(state)
    except ConfigError:
        return False


def folder_files(path: str) -> list[str]:
    """The data files a records folder is read from, in order: a save_to_disk data set's Arrow files (state.json's
    order), a DatasetDict's train split's, or the Parquet files (of the train split where they name splits).
    ConfigError naming the folder when none is there, or the splits when there are several and none is train."""
    if os.path.isfile(os.path.join(path, DATASET_DICT)):
        splits = _json(os.path.join(path, DATASET_DICT)).get("splits")
        if not isinstance(splits, list) or "train" not in splits:
            raise ConfigError(f"{path}: a DatasetDict whose splits are {splits!r} and none is \"train\": give the "
                              "folder of the split to train on")
        return folder_files(os.path.join(path, "train"))
    if os.path.isfile(os.path.join(path, STATE)):
        state = _json(os.path.join(path, STATE))
        files = state.get("_data_files")
        if not isinstance(files, list) or not files or not all(isinstance(f, dict) and "filename" in f for f in files):
            raise ConfigError(f"{path}: its {STATE} lists no \"_data_files\": not a folder datasets' save_to_disk "
                              "wrote")
        if state.get("_indices_data_files"):  # older datasets kept a selection as an index beside the table
            raise ConfigError(f"{path}: saved with an indices mapping (a select or shuffle not applied): save it again "
                              "with a recent datasets, or ds.flatten_indices().save_to_disk(...)")
        missing = [f["filename"] for f in files if not os.path.isfile(os.path.join(path, f["filename"]))]
        if missing:
            raise ConfigError(f"{path}: its {STATE} lists {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'}"
                              " not in the folder (copied without its data files?)")
        return [os.path.join(path, f["filename"]) for f in files]
    files = _parquet_files(path)
    splits = {_split_of(os.path.relpath(f, path)) for f in files}
    if len(splits) > 1:
        if "train" not in splits:
            named = ", ".join(sorted(s or "(none)" for s in splits))
            raise ConfigError(f"{path}: Parquet files of the splits {named} and none is \"train\": give the folder or "
                              "file of the split to train on")
        files = [f for f in files if _split_of(os.path.relpath(f, path)) == "train"]
    if not files:
        raise ConfigError(f"{path}: no Parquet or save_to_disk data files in it")
    return files


def folder_digest(path: str) -> str:
    """sha256 of the names and bytes of the data files a records folder is read from, in order: what its prepared
    copy in the cache is keyed by."""
    h = hashlib.sha256()
    for file in folder_files(path):
        h.update(f"{os.path.relpath(file, path)}\0{os.path.getsize(file)}\0".encode())
        with open(file, "rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
    return h.hexdigest()


def _split_of(relative: str) -> str | None:
    """The split a Parquet file of a hub download holds: its name's prefix (train-00000-of-00002.parquet), or a
    folder named like a split (train/0000.parquet); None if neither says."""
    match = SHARD_SPLIT.match(os.path.basename(relative))
    if match:
        return match.group("split")
    return next((part for part in reversed(relative.split(os.sep)[:-1]) if part in SPLIT_FOLDERS), None)


def _parquet_files(path: str) -> list[str]:
    found = []
    for folder, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # a hub download's .cache
        found += [os.path.join(folder, n) for n in names if n.lower().endswith(".parquet")]
    return sorted(found, key=lambda f: os.path.relpath(f, path))


def _json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a JSON file ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return value


def arrow_stream(path: str):
    """A reader of the record batches of an Arrow IPC stream file (what save_to_disk writes), memory-mapped."""
    import pyarrow
    import pyarrow.ipc
    try:
        return pyarrow.ipc.open_stream(pyarrow.memory_map(path))
    except (pyarrow.ArrowException, OSError) as e:
        raise ConfigError(f"{path}: not an Arrow stream pyarrow reads ({str(e).splitlines()[0]})") from None
