extension Gemma4Format {
    /// The ids of `messages` rendered in Gemma 4's format, as the Python runtime's `chat_ids` makes them: the
    /// format's control tokens count; the text of user and tool messages, of tool declarations and of call
    /// arguments stays text whatever it spells, unless `allowSpecialTokens`.
    public static func promptIDs(
        _ messages: [ChatMessage], tools: [ToolDefinition] = [], enableThinking: Bool = false,
        addGenerationPrompt: Bool = true, tokenizer: BPETokenizer, allowSpecialTokens: Bool = false
    ) throws -> [Int] {
        if allowSpecialTokens {
            return tokenizer.encode(try render(messages, tools: tools, enableThinking: enableThinking, addGenerationPrompt: addGenerationPrompt))
        }
        var texts = [String]()
        for m in messages {
            texts += [m.content, m.reasoning, m.name, m.toolCallID].compactMap { $0 }
            m.toolCalls.forEach { texts.append($0.name); $0.arguments.forEachString { texts.append($0) } }
        }
        for t in tools {
            texts += [t.name, t.description]
            t.parameters?.forEachString { texts.append($0) }
            t.response?.forEachString { texts.append($0) }
        }
        guard let mark = unusedMark(texts) else {
            throw GemmaANEError(.input, "messages: they hold every Unicode noncharacter (U+FDD0..U+FDEF, U+FFFE, U+FFFF, ...)")
        }
        let escape = { (text: String) in tokenizer.escapeControlTokens(text, mark: mark) }
        let escaped = messages.map { m -> ChatMessage in
            var m = m
            if m.role == .user || m.role == .tool { m.content = m.content.map(escape) }
            m.toolCalls = m.toolCalls.map { ToolCall(id: $0.id, name: $0.name, arguments: $0.arguments.mapStrings(escape)) }
            return m
        }
        let escapedTools = tools.map {
            ToolDefinition(
                name: escape($0.name), description: escape($0.description), parameters: $0.parameters?.mapStrings(escape),
                response: $0.response?.mapStrings(escape))
        }
        let text = try render(escaped, tools: escapedTools, enableThinking: enableThinking, addGenerationPrompt: addGenerationPrompt)
        return tokenizer.encodePrompt(text, mark: mark)
    }
}
