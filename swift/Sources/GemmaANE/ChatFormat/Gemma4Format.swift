/// Gemma 4's chat format written natively: what Google's chat template renders for a text conversation, a system
/// turn, thinking, tool declarations, tool calls and their results included (the Python package's
/// gemma_ane/runtime/gemma4.py, held equal to the template; the template's renderings are this one's golden test).
public enum Gemma4Format {
    static let q = "<|\"|>"  // the string delimiter, one token
    static let standardKeys: Set<String> = ["description", "type", "properties", "required", "nullable"]

    /// The prompt for `messages`, declaring `tools`; with `addGenerationPrompt`, the model's turn opened.
    public static func render(
        _ messages: [ChatMessage], tools: [ToolDefinition] = [], enableThinking: Bool = false,
        addGenerationPrompt: Bool = true, bos: String = "<bos>"
    ) throws -> String {
        var out = bos
        let system = messages.first.flatMap { [.system, .developer].contains($0.role) ? $0 : nil }
        if system != nil || enableThinking || !tools.isEmpty {  // thinking is switched on by <|think|> in a system turn
            out += "<|turn>system\n" + (enableThinking ? "<|think|>\n" : "") + pythonStrip(system?.content ?? "")
            for tool in tools { out += "<|tool>" + pythonStrip(try declaration(tool)) + "<tool|>" }
            out += "<turn|>\n"
        }
        let turns = Array(system == nil ? messages[...] : messages.dropFirst())
        let lastUser = turns.lastIndex { $0.role == .user } ?? -1
        var ended: String?  // what the last message ended in: "calls", "results"
        var previous: ChatMessage.Role?  // the last non-tool role
        for (i, m) in turns.enumerated() where m.role != .tool {
            let role = m.role == .assistant ? "model" : m.role.rawValue
            let responses = try Self.responses(m, following: turns[(i + 1)...])
            // consecutive assistant messages are one model turn (tool results between them included)
            if !(role == "model" && previous == .assistant) { out += "<|turn>\(role)\n" }
            if let thought = m.reasoning, !thought.isEmpty, i > lastUser {
                out += "<|channel>thought\n\(thought)\n<channel|>"
            }
            for call in m.toolCalls { out += try Self.call(call) }
            out += responses.joined()
            ended = !responses.isEmpty ? "results" : !m.toolCalls.isEmpty ? "calls" : nil
            let text = role == "model" ? stripThinking(m.content ?? "") : pythonStrip(m.content ?? "")
            out += text
            let after = turns[(i + 1)...].first { $0.role != .tool }?.role
            if ended == "calls" {
                out += "<|tool_response>"  // unanswered calls: the results come next, in this turn
            } else if !((role == "model" && after == .assistant)
                || (!responses.isEmpty && pythonStrip(text).isEmpty && after == nil))
            {
                out += "<turn|>\n"  // (results that end the conversation leave the turn open for the answer)
            }
            previous = m.role
        }
        if addGenerationPrompt && ended == nil {
            out += "<|turn>model\n"
        } else if addGenerationPrompt && ended == "results" && enableThinking {
            out += "<|channel>thought\n"
        }
        return out
    }

    /// The template's strip_thinking: a model turn loses every <|channel>...<channel|> block.
    static func stripThinking(_ text: String) -> String {
        let parts = ByteText.split(text, on: "<channel|>").map { ByteText.split($0, on: "<|channel>")[0] }
        return pythonStrip(parts.joined())
    }

    static func call(_ call: ToolCall) throws -> String {
        guard case .object = call.arguments else {
            throw GemmaANEError(.input, "tool_calls[].function.arguments: expected a JSON object, got \(call.arguments.pythonText.prefix(40))")
        }
        return "<|tool_call>call:\(call.name)\(value(call.arguments))<tool_call|>"
    }

    static func response(_ name: String, _ body: JSONValue) -> String {
        let text = body.members != nil ? value(body) : "{value:" + value(body) + "}"
        return "<|tool_response>response:\(name)\(text)<tool_response|>"
    }

    /// The results answering `message`'s calls: the tool messages right after it, each named by the call its
    /// tool_call_id points at (the last match wins, as in the template), else by its own name.
    static func responses(_ message: ChatMessage, following: ArraySlice<ChatMessage>) throws -> [String] {
        guard !message.toolCalls.isEmpty else { return [] }
        return following.prefix { $0.role == .tool }.map { m in
            var name = m.name.flatMap { $0.isEmpty ? nil : $0 } ?? "unknown"
            for call in message.toolCalls where call.id == m.toolCallID { name = call.name }
            return response(name, m.content.map { .string($0) } ?? .null)
        }
    }

    // MARK: the template's macros

    /// jinja's dictsort: by key, compared lowercased (a stable sort: equal keys keep their order).
    static func dictsort(_ members: [JSONValue.Member]) -> [JSONValue.Member] {
        members.enumerated().sorted {
            let a = $0.element.key.lowercased(), b = $1.element.key.lowercased()
            return a != b ? a < b : $0.offset < $1.offset
        }.map(\.element)
    }

    /// format_argument: a JSON value as Gemma writes it, keys bare or (escapeKeys) delimited.
    static func value(_ v: JSONValue, escapeKeys: Bool = false) -> String {
        switch v {
        case .null: return "null"
        case .string(let s): return q + s + q
        case .bool(let b): return b ? "true" : "false"
        case .object(let members):
            return "{" + dictsort(members).map { (escapeKeys ? q + $0.key + q : $0.key) + ":" + value($0.value, escapeKeys: escapeKeys) }
                .joined(separator: ",") + "}"
        case .array(let items): return "[" + items.map { value($0, escapeKeys: escapeKeys) }.joined(separator: ",") + "]"
        case .int, .double: return v.pythonText
        }
    }

    /// `schema[key] | upper`: a missing item prints ''.
    static func upper(_ schema: JSONValue?, _ key: String) -> String {
        guard let item = schema?[key] else { return "" }
        return item.pythonText.uppercased()
    }

    static func quoted(_ items: JSONValue) -> String {
        guard case .array(let list) = items else { return quoted(.array([items])) }
        return list.map { q + $0.pythonText + q }.joined(separator: ",")
    }

    /// format_parameters: each property's schema, keys sorted.
    static func properties(_ properties: [JSONValue.Member], filterKeys: Bool = false) -> String {
        var out = [String]()
        for member in dictsort(properties) {
            if filterKeys && standardKeys.contains(member.key) { continue }
            let v = member.value
            let kind = upper(v, "type")
            var fields = [String]()
            if let d = v["description"], d.truthy { fields.append("description:\(q)\(d.pythonText)\(q)") }
            if kind == "STRING", let e = v["enum"], e.truthy {
                fields.append("enum:" + value(e, escapeKeys: true))
            } else if kind == "ARRAY", let items = v["items"], let m = items.members, !m.isEmpty {
                fields.append("items:{" + Self.items(m) + "}")
            }
            if let n = v["nullable"], n.truthy { fields.append("nullable:true") }
            if kind == "OBJECT" {
                // without "properties", the schema's own non-standard keys stand for them
                if let nested = v["properties"]?.members {
                    fields.append("properties:{" + Self.properties(nested) + "}")
                } else {
                    fields.append("properties:{" + Self.properties(v.members ?? [], filterKeys: true) + "}")
                }
                if let r = v["required"], r.truthy { fields.append("required:[\(quoted(r))]") }
            }
            fields.append("type:\(q)\(kind)\(q)")
            out.append("\(member.key):{\(fields.joined(separator: ","))}")
        }
        return out.joined(separator: ",")
    }

    /// An array's `items` schema, as format_parameters writes it.
    static func items(_ items: [JSONValue.Member]) -> String {
        var out = [String]()
        for member in dictsort(items) {
            let v = member.value
            if v == .null { continue }
            switch member.key {
            case "properties": out.append("properties:{" + (v.members.map { properties($0) } ?? "") + "}")
            case "required": out.append("required:[\(quoted(v))]")
            case "type":
                if case .array(let kinds) = v {
                    out.append("type:" + value(.array(kinds.map { .string($0.pythonText.uppercased()) }), escapeKeys: true))
                } else {
                    out.append("type:" + value(.string(v.string?.uppercased() ?? v.pythonText), escapeKeys: true))
                }
            default: out.append("\(member.key):\(value(v, escapeKeys: true))")
            }
        }
        return out.joined(separator: ",")
    }

    /// format_function_declaration: what goes between <|tool> and <tool|>.
    static func declaration(_ tool: ToolDefinition) throws -> String {
        var out = "declaration:\(tool.name){description:\(q)\(tool.description)\(q)"
        if let params = tool.parameters, params.truthy {
            out += ",parameters:{"
            if let p = params["properties"], p.truthy { out += "properties:{" + properties(p.members ?? []) + "}," }
            if let r = params["required"], r.truthy { out += "required:[\(quoted(r))]," }
            if let t = params["type"], t.truthy { out += "type:\(q)\(upper(params, "type"))\(q)}" }  // closed only here
        }
        if let response = tool.response {
            out += ",response:{"
            if let d = response["description"], d.truthy { out += "description:\(q)\(d.pythonText)\(q)," }
            if upper(response, "type") == "OBJECT" { out += "type:\(q)OBJECT\(q)}" }
        }
        return out + "}"
    }
}

/// Python's `str.strip()` (and Jinja's `trim`): Unicode whitespace and the four separators U+001C-U+001F.
func pythonStrip(_ text: String) -> String {
    func space(_ c: Unicode.Scalar) -> Bool { c.properties.isWhitespace || (0x1C...0x1F).contains(c.value) }
    let scalars = text.unicodeScalars
    guard let first = scalars.firstIndex(where: { !space($0) }) else { return "" }
    let last = scalars.lastIndex(where: { !space($0) })!
    return String(scalars[first...last])
}
