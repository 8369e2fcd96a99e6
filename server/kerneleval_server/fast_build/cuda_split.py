"""Splits a load_inline `.cu` file into a device unit and a host unit, so that only g++ (with
a precompiled torch header) ever reads torch's headers, and nvcc reads the kernels alone.

Why: nvcc parses a translation unit twice in its EDG front end (cudafe++ and cicc), with no
precompiled headers; a `.cu` that includes torch/extension.h spends over 99% of its 45 s build
there (issue 15). A candidate's kernels rarely need torch; its host wrapper does.

    device unit (nvcc):  the source's includes minus torch's, its types and constants, its
                         __global__/__device__ code, and one launch function per kernel;
    host unit (g++):     everything else, each `k<<<g, b, s, st>>>(args)` rewritten into a call
                         of k's launch function.

A launch function is variadic (`template <typename... A> void launch(dim3, dim3, size_t,
cudaStream_t, A... a) { k<<<...>>>(a...); }`): the arguments convert to the kernel's parameter
types at the launch itself, as in the original. Which instantiations the device unit must hold
is read back from the host object's undefined symbols (`instantiations`).

The split is conservative: anything it does not understand raises SplitError, and the caller
builds the file as torch would. A split that compiles means what the original means: the same
declarations reach the same code; only the compiler that reads the host code differs (g++, as
nvcc's own host pass uses)."""

from __future__ import annotations

import dataclasses
import re

LAUNCH_PREFIX = "kerneleval_launch_"

# Headers only the host unit gets (the device unit must compile without them).
_HOST_HEADERS = re.compile(r"#\s*include\s*[<\"](torch/|ATen/|c10/|pybind11/|Python\.h)")
_INCLUDE = re.compile(r"#\s*include\b")
# The device side cannot follow host code that asks which compiler reads it (nvcc predefines
# __CUDACC__, __CUDACC_VER_MAJOR__, __NVCC__, __CUDA_ARCH__, __CUDA_ARCH_LIST__, ...).
_COMPILER_MACROS = re.compile(r"\b(__CUDACC\w*|__NVCC\w*|__CUDA_ARCH\w*)")
# A conditional in device code may test only what both units define the same way: the
# source's own macros and these (torch's headers, which only the host unit reads, define
# thousands).
_CONDITIONAL = re.compile(r"^[ \t]*#[ \t]*(?:el)?if(?:n?def)?\b((?:.*\\\n)*.*)$", re.M)
_DEFINE = re.compile(r"^[ \t]*#[ \t]*(?:define|undef)[ \t]+([A-Za-z_]\w*)", re.M)
_PP_SAME = {"defined", "__has_include", "__has_include_next", "__has_cpp_attribute",
            "__has_attribute", "__has_builtin", "true", "false", "__cplusplus", "__GNUC__",
            "__GNUC_MINOR__", "__GNUC_PATCHLEVEL__", "__clang__", "__linux__", "__x86_64__",
            "__aarch64__", "_WIN32", "_MSC_VER", "CUDART_VERSION"}  # fmt: skip
# ... and what the system headers that cuda_runtime.h includes (in both units) define
_PP_SYSTEM = re.compile(r"M_[A-Z0-9_]+|INFINITY|NAN|HUGE_VALF?|U?INT_MAX|INT_MIN|CHAR_BIT")
_IDENT = re.compile(r"[A-Za-z_]\w*")
_TORCH_NAMES = re.compile(r"\b(torch|at|c10|pybind11|py)\s*::|\bTORCH_|\bAT_|\bC10_")


class SplitError(Exception):
    """The source cannot be split safely; build it whole."""


@dataclasses.dataclass
class Split:
    device: str  # the device unit (.cu), with #line directives into the original
    host: str  # the host unit (.cpp)
    kernels: list[str]  # the kernels launched from host code
    # Explicit instantiations of the launch functions whose types the source says (a
    # non-template kernel: the host passes its arguments as the kernel's parameter types,
    # converted at the call as a launch converts them). `typed`: every launched kernel is
    # such, so the device unit needs nothing of the host object and compiles beside it.
    typed_instantiations: str = ""
    typed: bool = False


@dataclasses.dataclass
class _Item:
    text: str  # the item's original text
    start: int  # its offset in the source
    kind: str  # "pp", "kernel", "device", "host", "both", "namespace_open", "close"
    name: str = ""
    template: str = ""  # "template <...>" of a kernel


def split(source: str, path: str) -> Split:
    if _COMPILER_MACROS.search(source):
        raise SplitError("the source tests which compiler reads it")
    for m in re.finditer(r"^[ \t]*#(?:.*\\\n)*.*", _mask(source), re.M):
        if "<<<" in m.group():
            raise SplitError("a launch in a macro")  # the host unit cannot compile it
    items = _items(source)
    kernels: dict[str, _Item] = {}
    for it in items:
        if it.kind == "kernel":
            if it.name in kernels:
                raise SplitError(f"kernel {it.name} is overloaded")
            kernels[it.name] = it
    host_text = "".join(it.text for it in items if it.kind == "host")
    if any("<<<" in _strip(it.text) for it in items if it.kind == "both"):
        raise SplitError("a launch in __host__ __device__ code")  # g++ reads it too
    launched = _check_kernel_uses(host_text, kernels)
    _check_device_variables(host_text, items)
    _check_conditionals("".join(it.text for it in items if it.kind != "host"))
    typed = {name: t for name in launched if (t := _param_types(kernels[name])) is not None}
    dev: list[str] = []
    host: list[str] = ["#include <cuda_runtime.h>\n"]  # as nvcc includes it first
    scopes = 0  # namespaces and extern "C" blocks open at this item
    for it in items:
        line = f'\n#line {source.count(chr(10), 0, it.start) + 1} "{path}"\n'
        if it.kind == "both" and _strip(it.text).endswith("{"):
            scopes += 1
        elif it.kind == "both" and it.text == "}":
            scopes -= 1
        if it.kind == "kernel" and it.name in launched and scopes:
            # its launch function would be declared there (a template cannot have C linkage,
            # one in an unnamed namespace no external linkage) and defined at the end
            raise SplitError(f'kernel {it.name} is in a namespace or extern "C" block')
        if it.kind == "pp":
            host.append(line + it.text)
            if not _HOST_HEADERS.match(it.text.strip()):
                dev.append(line + it.text)
        elif it.kind in ("kernel", "device"):
            dev.append(line + it.text)
            if it.name in launched:  # declared where the kernel was: its types are known
                host.append(_launch_declaration(it))
        elif it.kind == "host":
            host.append(line + _rewrite_launches(it.text, kernels, typed))
        else:  # both: types, constants, namespace braces, __host__ __device__ code
            dev.append(line + it.text)
            host.append(line + it.text)
    for name in launched:
        k = kernels[name]
        tparams = _template_params(k.template)
        targs = f"<{', '.join(_param_name(p) for p in tparams)}>" if tparams else ""
        lead = f"{', '.join(tparams)}, " if tparams else ""
        dev.append(
            f"\ntemplate <{lead}typename... A> void {LAUNCH_PREFIX}{name}"
            "(dim3 g, dim3 b, size_t s, cudaStream_t st, A... a) "
            f"{{ {name}{targs}<<<g, b, s, st>>>(a...); }}\n"
        )
    inst = "".join(
        f"template void {LAUNCH_PREFIX}{name}<{', '.join(types)}>"
        f"(dim3, dim3, size_t, cudaStream_t{''.join(', ' + t for t in types)});\n"
        for name, types in typed.items()
    )
    return Split(
        device="".join(dev),
        host="".join(host),
        kernels=launched,
        typed_instantiations=inst,
        typed=len(typed) == len(launched),
    )


# C++ words that are never a parameter's name: "unsigned int" is a type without a name.
_TYPE_WORDS = frozenset(
    "int long short char float double bool unsigned signed const volatile void auto "
    "__restrict__ __restrict restrict struct class enum size_t".split()
)


def _param_types(kernel: _Item) -> list[str] | None:
    """A non-template kernel's parameter types as written, names and defaults dropped; None
    where they cannot be read plainly (a template kernel, an unnamed parameter, an array or a
    function pointer): its launch then takes the types the host object says."""
    if kernel.template:
        return None
    head = re.sub(r"__launch_bounds__\s*\([^)]*\)", " ", _strip(kernel.text).split("{")[0])
    open_at = head.find("(")
    if open_at < 0:
        return None
    inner = head[open_at + 1 : _paren_end(_mask(head), open_at)]
    if inner.strip() in ("", "void"):
        return []
    types = []
    for param in _split_top(inner):
        param = param.split("=")[0].strip()
        m = re.fullmatch(r"([\w\s\*&:<>,]*?[\s\*&>])([A-Za-z_]\w*)", param)
        qualifiers = {"const", "volatile", "__restrict__", "__restrict", "struct", "enum", "class"}
        if (
            m is None
            or m.group(2) in _TYPE_WORDS
            or not set(_IDENT.findall(m.group(1))) - qualifiers
        ):
            return None  # "const T" names no parameter: T is the type
        # restrict qualifies the kernel's own parameter, not the value passed in (and nvcc
        # takes no restrict in a template argument)
        words = [w for w in m.group(1).replace("*", " * ").split() if w not in _RESTRICT]
        types.append(" ".join(words).replace(" *", "*"))
    return types


_RESTRICT = frozenset({"__restrict__", "__restrict", "restrict"})


def _launch_declaration(kernel: _Item) -> str:
    tparams = _template_params(kernel.template)
    lead = f"{', '.join(tparams)}, " if tparams else ""
    return (
        f"\ntemplate <{lead}typename... A> void {LAUNCH_PREFIX}{kernel.name}"
        "(dim3, dim3, size_t, cudaStream_t, A...);\n"
    )


def instantiations(undefined_symbols: list[str]) -> str:
    """Explicit instantiations of the launch functions the host object calls, from its
    undefined symbols demangled (`nm -C -u`): appended to the device unit."""
    out = []
    for sym in undefined_symbols:
        sym = re.sub(r"^\s*[Uw]\s+", "", sym).strip()  # nm's "U" (undefined) column
        if LAUNCH_PREFIX not in sym:
            continue
        if "(anonymous namespace)" in sym or "{lambda" in sym:
            raise SplitError(f"a launch with an unnamed type: {sym}")
        # nm -C prints "void kerneleval_launch_k<float*, int>(dim3, ..., int)"; it may omit
        # the return type
        sym = sym if sym.startswith("void ") else f"void {sym}"
        out.append(f"template {sym};\n")
    return "".join(out)


# ---- items ---------------------------------------------------------------------------------


def _items(src: str) -> list[_Item]:
    """Top-level items: preprocessor lines, and declarations up to their `;` or body's `}`.
    Namespaces (and extern "C" blocks) are opened and closed as items of their own."""
    items: list[_Item] = []
    i, n, start, depth = 0, len(src), 0, 0
    scope: list[int] = []  # depth at which each open namespace's body lives
    while i < n:
        c = src[i]
        if c == "#" and _mask(src[start:i]).strip() == "" and _at_line_start(src, i):
            j = _line_end(src, i)
            _flush(items, src, start, i)
            items.append(_Item(src[i:j], i, "pp"))
            i = start = j
            continue
        if src.startswith("//", i):
            i = _line_end(src, i)
            continue
        if src.startswith("/*", i):
            j = src.find("*/", i + 2)
            if j < 0:
                raise SplitError("an unterminated comment")
            i = j + 2
            continue
        if c in "\"'":
            i = _skip_literal(src, i)
            continue
        if c == "R" and src.startswith('R"', i):
            m = re.match(r'R"([^(]*)\(', src[i:])
            if m:
                end = src.find(f'){m.group(1)}"', i)
                if end < 0:
                    raise SplitError("an unterminated raw string")
                i = end + len(m.group(1)) + 2
                continue
        if c == "{":
            head = re.sub(r"//[^\n]*|/\*.*?\*/", " ", src[start:i], flags=re.S).strip()
            if depth == len(scope) and re.fullmatch(
                r'(inline\s+)?namespace(\s+[\w:]+)?|extern\s*"C(\+\+)?"', head
            ):
                items.append(_Item(src[start : i + 1], start, "both"))
                scope.append(depth + 1)
                start = i + 1
            depth += 1
        elif c == "}":
            depth -= 1
            if depth < 0:
                raise SplitError("unbalanced braces")
            if scope and depth + 1 == scope[-1] and depth == len(scope) - 1:
                _flush(items, src, start, i)
                items.append(_Item("}", i, "both"))
                scope.pop()
                start = i + 1
            elif depth == len(scope) and _is_body_end(src, start, i):
                items.append(_classify(src[start : i + 1], start))
                start = i + 1
        elif c == ";" and depth == len(scope):
            items.append(_classify(src[start : i + 1], start))
            start = i + 1
        i += 1
    if depth or scope:
        raise SplitError("unbalanced braces")
    _flush(items, src, start, n)
    return items


def _flush(items: list[_Item], src: str, start: int, end: int) -> None:
    text = src[start:end]
    if _strip(text):
        raise SplitError(f"cannot read the code at offset {start}: {text.strip()[:60]!r}")
    if text:
        items.append(_Item(text, start, "both"))  # whitespace and comments


def _is_body_end(src: str, start: int, close: int) -> bool:
    """A `}` at item level ends a function body unless the item is a class, struct, union or
    enum (those end at their `;`) or an initializer (`= {...};`)."""
    head = _strip(src[start:close])
    body_open = _matching_open(head)
    before = head[:body_open]
    while m := re.match(r"\s*template\s*<", before):  # template <int N = 4>
        before = before[_angle_end(before, m.end() - 1) + 1 :]
    before = re.sub(r"\boperator\s*[^\w\s(]+", "operator", before)  # operator+=
    if re.search(r"\b(class|struct|union|enum)\b", before) and "(" not in before:
        return False
    return "=" not in before.split("(")[0] and "(" in before


def _matching_open(text: str) -> int:
    depth = 0
    for i in range(len(text) - 1, -1, -1):
        if text[i] == "}":
            depth += 1
        elif text[i] == "{":
            if depth == 0:
                return i
            depth -= 1
    return len(text)


def _classify(text: str, start: int) -> _Item:
    code = _strip(text)
    head = code.split("{")[0] if "{" in code else code
    template = ""
    m = re.match(r"\s*(template\s*<)", head)
    if m:
        close = _angle_end(head, m.end() - 1)
        template = head[: close + 1].strip()
        head = head[close + 1 :]
    words = set(_IDENT.findall(re.sub(r"__launch_bounds__\s*\([^)]*\)", " ", head).split("(")[0]))
    if "__global__" in words:
        name = _function_name(head)
        if not code.rstrip().endswith("}"):
            raise SplitError(f"a kernel declared apart from its definition: {name}")
        return _Item(text, start, "kernel", name=name, template=template)
    if {"__host__", "__device__"} <= words:
        return _Item(text, start, "both")
    if words & {"__device__", "__constant__", "__shared__", "__managed__"}:
        return _Item(text, start, "device")
    if re.match(r"\s*(typedef|using|namespace)\b", head) and "{" not in code:
        if re.search(r"\b(cooperative_groups|nvcuda)\b", code):
            return _Item(text, start, "device")  # declared by nvcc's headers only (g++: empty)
        if _TORCH_NAMES.search(code) or re.search(r"\b(torch|at|c10|pybind11)\s*;", code):
            return _Item(text, start, "host")  # using namespace torch; using torch::Tensor;
    if re.match(r"\s*(typedef|using|namespace|struct|class|union|enum|static_assert)\b", head):
        return _Item(text, start, "both")
    if "(" not in head.split("=")[0]:
        # a variable: constants go to both units, anything else is host state
        is_const = words & {"const", "constexpr"} and not _TORCH_NAMES.search(code)
        return _Item(text, start, "both" if is_const else "host")
    if "constexpr" in words and not _TORCH_NAMES.search(code):
        return _Item(text, start, "both")
    return _Item(text, start, "host")


def _function_name(head: str) -> str:
    head = re.sub(r"__launch_bounds__\s*\([^)]*\)", " ", head)
    before = head.split("(")[0]
    names = _IDENT.findall(before)
    if not names:
        raise SplitError("a kernel without a name")
    return str(names[-1])


def _template_params(template: str) -> list[str]:
    if not template:
        return []
    inner = template[template.index("<") + 1 : template.rindex(">")]
    params = [p.strip() for p in _split_top(inner)]
    out = []
    for p in params:
        p = p.split("=")[0].strip()  # defaults stay on the kernel
        if not p or "..." in p:
            raise SplitError("a kernel template with a parameter pack")
        out.append(p)
    return out


def _param_name(param: str) -> str:
    names = _IDENT.findall(param)
    if len(names) < 2:
        raise SplitError(f"an unnamed template parameter: {param}")
    return str(names[-1])


def _check_kernel_uses(host: str, kernels: dict[str, _Item]) -> list[str]:
    """Kernels launched from host code; a kernel named there other than in a launch (its
    address taken for cudaFuncSetAttribute, say) cannot be split."""
    code = _strip(host)
    launched = []
    for name in kernels:
        uses = [m.start() for m in re.finditer(rf"\b{re.escape(name)}\b", code)]
        launches = [m.start() for m in _launch_re(name).finditer(code)]
        if len(uses) != len(launches):
            raise SplitError(f"kernel {name} is used other than in a launch")
        if launches:
            launched.append(name)
    return launched


def _check_device_variables(host: str, items: list[_Item]) -> None:
    """A __device__/__constant__/__shared__/__managed__ variable is only in the device unit:
    host code that names it (cudaMemcpyToSymbol) would find another declaration or none."""
    code = _strip(host)
    for it in items:
        if it.kind != "device":
            continue
        head = re.split(r"[=;{]", _strip(it.text), maxsplit=1)[0]
        if "(" in head:
            continue  # a __device__ function: host code calling it does not compile
        for part in _split_top(head):
            names = _IDENT.findall(re.sub(r"\[[^\]]*\]", " ", part))
            if names and re.search(rf"\b{names[-1]}\b", code):
                raise SplitError(f"device variable {names[-1]} is named in host code")


def _check_conditionals(device: str) -> None:
    """Conditionals the device unit reads must test macros both units define alike."""
    known = set(_PP_SAME)
    masked = _mask(device)
    events = [(m.start(), "define", m.group(1)) for m in _DEFINE.finditer(masked)]
    events += [(m.start(), "test", m.group(1)) for m in _CONDITIONAL.finditer(masked)]
    for _, what, text in sorted(events):
        if what == "define":
            known.add(text)
            continue
        for name in _IDENT.findall(re.sub(r"<[^>]*>|\b\d[\w.']*", " ", text)):  # 201703L
            if name not in known and not _PP_SYSTEM.fullmatch(name):
                raise SplitError(
                    f"a preprocessor conditional on {name}, which torch's headers may define"
                )


def _launch_re(name: str) -> re.Pattern[str]:
    return re.compile(rf"\b{re.escape(name)}\s*(<(?:[^<>]|<[^<>]*>)*>\s*)?<<<")


def _rewrite_launches(
    text: str, kernels: dict[str, _Item], typed: dict[str, list[str]] | None = None
) -> str:
    """`k<T><<<g, b, s, st>>>(args)` -> `kerneleval_launch_k<T>(g, b, s, st, args)`; a kernel
    in `typed` gets its parameter types as the launch function's: `kerneleval_launch_k<const
    float*, int>(g, b, s, st, args)`."""
    out, i = [], 0
    masked = _mask(text)
    while True:
        m = re.search(r"\b([A-Za-z_]\w*)\s*(<(?:[^<>]|<[^<>]*>)*>\s*)?<<<", masked[i:])
        if not m:
            out.append(text[i:])
            break
        name = m.group(1)
        if name not in kernels:
            raise SplitError(f"a launch of {name}, which is not a kernel of this source")
        begin = i + m.start()
        cfg_start = i + m.end()
        cfg_end = masked.find(">>>", cfg_start)
        if cfg_end < 0:
            raise SplitError("an unterminated launch")
        cfg = _split_top(text[cfg_start:cfg_end], angles=False)
        if not 2 <= len(cfg) <= 4:
            raise SplitError(f"a launch of {name} with {len(cfg)} configuration values")
        cfg += ["0"] * (4 - len(cfg))
        paren = masked.find("(", cfg_end + 3)
        if paren < 0 or masked[cfg_end + 3 : paren].strip():
            raise SplitError(f"a launch of {name} without arguments")
        targs = m.group(2) or ""
        given = len([a for a in _split_top(targs.strip()[1:-1]) if a.strip()]) if targs else 0
        wanted = len(_template_params(kernels[name].template))
        if given != wanted:  # the rest deduced or defaulted: the launch function cannot
            raise SplitError(f"a launch of {name} with {given} of its {wanted} template arguments")
        if typed and name in typed:
            targs = f"<{', '.join(typed[name])}>"
        call = f"{LAUNCH_PREFIX}{name}{targs.strip()}({', '.join(c.strip() for c in cfg)}"
        lines = "\n" * (text.count("\n", begin, paren) - call.count("\n"))  # keep #line true
        close = _paren_end(masked, paren)
        args = text[paren + 1 : close]
        call += f",{lines} {args})" if args.strip() else f"{lines})"
        out.append(text[i:begin] + call)
        i = close + 1
    return "".join(out)


# ---- lexing helpers ------------------------------------------------------------------------


def _at_line_start(src: str, i: int) -> bool:
    j = src.rfind("\n", 0, i)
    return src[j + 1 : i].strip() == ""


def _line_end(src: str, i: int) -> int:
    while True:
        j = src.find("\n", i)
        if j < 0:
            return len(src)
        if src[j - 1] != "\\":
            return j + 1
        i = j + 1


def _skip_literal(src: str, i: int) -> int:
    quote = src[i]
    j = i + 1
    while j < len(src):
        if src[j] == "\\":
            j += 2
            continue
        if src[j] == quote:
            return j + 1
        if src[j] == "\n":
            break
        j += 1
    if quote == "'":
        return i + 1  # a digit separator (1'000'000), not a character literal
    raise SplitError("an unterminated string")


def _mask(text: str) -> str:
    """The text with comments and literals blanked (same length), for searching code."""
    out = list(text)
    i = 0
    while i < len(text):
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = len(text) if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = len(text) if j < 0 else j + 2
        elif text.startswith('R"', i) and (m := re.match(r'R"([^(\s]*)\(', text[i:])):
            j = text.find(f'){m.group(1)}"', i)
            j = len(text) if j < 0 else j + len(m.group(1)) + 2
        elif text[i] in "\"'":
            j = _skip_literal(text, i)
            if j == i + 1:
                i += 1
                continue
        else:
            i += 1
            continue
        for k in range(i, j):
            if out[k] != "\n":
                out[k] = " "
        i = j
    return "".join(out)


def _strip(text: str) -> str:
    """Code only: no comments, no preprocessor lines, literals blanked."""
    lines = [ln for ln in _mask(text).split("\n") if not ln.lstrip().startswith("#")]
    return "\n".join(lines).strip()


def _split_top(text: str, angles: bool = True) -> list[str]:
    """Split on commas outside (), [], {} (and <>, for template parameter lists)."""
    opens, closes = ("([{<", ")]}>") if angles else ("([{", ")]}")
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for c in _mask(text) if text else "":
        if c in opens:
            depth += 1
        elif c in closes:
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    # map back onto the original text (same length as the mask)
    out, pos = [], 0
    for p in parts:
        out.append(text[pos : pos + len(p)])
        pos += len(p) + 1
    return out


def _angle_end(text: str, open_at: int) -> int:
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "<":
            depth += 1
        elif text[i] == ">":
            depth -= 1
            if depth == 0:
                return i
    raise SplitError("an unterminated template parameter list")


def _paren_end(masked: str, open_at: int) -> int:
    depth = 0
    for i in range(open_at, len(masked)):
        if masked[i] == "(":
            depth += 1
        elif masked[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    raise SplitError("an unterminated argument list")
