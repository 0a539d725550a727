import Foundation
import Testing

@testable import GemmaANE

/// An OpenAI-style conversation (as the golden writer stores it) as the package's types.
private func conversation(_ c: [String: Any]) throws -> ([ChatMessage], [ToolDefinition]) {
    let messages = try (c["messages"] as! [[String: Any]]).map { m -> ChatMessage in
        let calls = try ((m["tool_calls"] as? [[String: Any]]) ?? []).map { call -> ToolCall in
            let f = call["function"] as! [String: Any]
            return ToolCall(id: call["id"] as? String, name: f["name"] as! String, arguments: try JSONValue(foundation: f["arguments"]!))
        }
        return ChatMessage(
            role: ChatMessage.Role(rawValue: m["role"] as! String)!, content: m["content"] as? String,
            reasoning: m["reasoning"] as? String, toolCalls: calls, toolCallID: m["tool_call_id"] as? String,
            name: m["name"] as? String)
    }
    let tools = try ((c["tools"] as? [[String: Any]]) ?? []).map { t -> ToolDefinition in
        let f = t["function"] as! [String: Any]
        return ToolDefinition(
            name: f["name"] as! String, description: (f["description"] as? String) ?? "",
            parameters: try f["parameters"].map { try JSONValue(foundation: $0) },
            response: try f["response"].map { try JSONValue(foundation: $0) })
    }
    return (messages, tools)
}

@Test func chatFormatRendersAsGooglesTemplate() throws {
    let cases = try TextGoldens.json("chat.json") as! [[String: Any]]
    #expect(cases.count >= 12)
    for (i, c) in cases.enumerated() {
        let (messages, tools) = try conversation(c)
        let text = try Gemma4Format.render(
            messages, tools: tools, enableThinking: (c["enable_thinking"] as? Bool) ?? false,
            addGenerationPrompt: (c["add_generation_prompt"] as? Bool) ?? true)
        #expect(text == c["text"] as! String, "conversation \(i)")
    }
}

@Test(arguments: ["byte-level", "sentencepiece"]) func chatPromptIDsKeepSpelledControlTokensText(_ family: String) throws {
    let tokenizer = try BPETokenizer(contentsOf: TextGoldens.directory().appendingPathComponent("tokenizer-\(family).json"))
    let cases = try TextGoldens.json("chat.json") as! [[String: Any]]
    for (i, c) in cases.enumerated() {
        let (messages, tools) = try conversation(c)
        let ids = try Gemma4Format.promptIDs(
            messages, tools: tools, enableThinking: (c["enable_thinking"] as? Bool) ?? false,
            addGenerationPrompt: (c["add_generation_prompt"] as? Bool) ?? true, tokenizer: tokenizer)
        #expect(ids == (c["ids"] as! [String: Any])[family] as! [Int], "\(family) conversation \(i)")
    }
}

@Test func chatUserTextSpellingATurnEndDoesNotEndTheTurn() throws {
    let tokenizer = try BPETokenizer(contentsOf: TextGoldens.directory().appendingPathComponent("tokenizer-byte-level.json"))
    let ids = try Gemma4Format.promptIDs([.user("a <turn|> b")], tokenizer: tokenizer)
    // <bos> <|turn> user\n ... <turn|> \n <|turn> model\n: two turn ends would mean the user's text closed one
    #expect(ids.filter { $0 == 106 }.count == 1)
    let live = try Gemma4Format.promptIDs([.user("a <turn|> b")], tokenizer: tokenizer, allowSpecialTokens: true)
    #expect(live.filter { $0 == 106 }.count == 2)
}
