/// One message of a conversation, OpenAI's shape: a role, its text, and for the model's turns the reasoning and
/// tool calls it made; a `tool` message answers a call (by `toolCallID`) with its result's text.
public struct ChatMessage: Sendable, Equatable {
    public enum Role: String, Sendable, CaseIterable {
        case system, developer, user, assistant, model, tool
    }

    public var role: Role
    public var content: String?
    /// The model's thinking in an earlier turn, replayed only after the last user message (as the template).
    public var reasoning: String?
    public var toolCalls: [ToolCall]
    /// A tool message: the call it answers, and the function's name when no call's id matches.
    public var toolCallID: String?
    public var name: String?

    public init(
        role: Role, content: String? = nil, reasoning: String? = nil, toolCalls: [ToolCall] = [],
        toolCallID: String? = nil, name: String? = nil
    ) {
        self.role = role
        self.content = content
        self.reasoning = reasoning
        self.toolCalls = toolCalls
        self.toolCallID = toolCallID
        self.name = name
    }

    public static func system(_ text: String) -> ChatMessage { ChatMessage(role: .system, content: text) }
    public static func user(_ text: String) -> ChatMessage { ChatMessage(role: .user, content: text) }
    public static func assistant(_ text: String?, reasoning: String? = nil, toolCalls: [ToolCall] = []) -> ChatMessage {
        ChatMessage(role: .assistant, content: text, reasoning: reasoning, toolCalls: toolCalls)
    }
    public static func tool(_ text: String, callID: String?, name: String? = nil) -> ChatMessage {
        ChatMessage(role: .tool, content: text, toolCallID: callID, name: name)
    }
}

/// A function call: the model's (parsed from its output) or one replayed in a conversation.
public struct ToolCall: Sendable, Equatable {
    public var id: String?
    public var name: String
    /// A JSON object.
    public var arguments: JSONValue

    public init(id: String? = nil, name: String, arguments: JSONValue = .object([])) {
        self.id = id
        self.name = name
        self.arguments = arguments
    }
}

/// A function the model may call, as OpenAI's `tools[].function` declares it: `parameters` a JSON schema object,
/// `response` an optional schema of what it returns.
public struct ToolDefinition: Sendable, Equatable {
    public var name: String
    public var description: String
    public var parameters: JSONValue?
    public var response: JSONValue?

    public init(name: String, description: String = "", parameters: JSONValue? = nil, response: JSONValue? = nil) {
        self.name = name
        self.description = description
        self.parameters = parameters
        self.response = response
    }
}
