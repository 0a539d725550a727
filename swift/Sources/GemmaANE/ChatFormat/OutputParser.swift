import Foundation

/// What one generated token adds to the answer: text, reasoning, or whole tool calls.
public struct OutputDelta: Sendable, Equatable {
    public var content = ""
    public var reasoning = ""
    public var toolCalls: [ToolCall] = []

    public init(content: String = "", reasoning: String = "", toolCalls: [ToolCall] = []) {
        self.content = content
        self.reasoning = reasoning
        self.toolCalls = toolCalls
    }

    public var isEmpty: Bool { content.isEmpty && reasoning.isEmpty && toolCalls.isEmpty }
}

/// Splits generated tokens into answer, reasoning (`<|channel>thought\n ... <channel|>`) and tool calls
/// (`<|tool_call>call:NAME{...}<tool_call|>`), and applies stop strings to the answer, holding back any tail that
/// could still become one: the Python runtime's `OutputParser` (gemma_ane/runtime/chat.py). A call is released once
/// closed: as a ToolCall if it parses and names one of `toolNames` (any name when nil), else as text; one never
/// closed is dropped.
public struct OutputParser: Sendable {
    static let channelOpen = 100, channelClose = 101, toolCallOpen = 48, toolCallClose = 49
    public static let maxStops = 4  // as OpenAI allows
    public static let maxStopCharacters = 1000

    private let tokenizer: any Tokenizer
    private var content: StreamingDetokenizer
    private var reasoning: StreamingDetokenizer
    private var inThought = false, skipLabel = false
    private var label = ""
    private let stops: [[Unicode.Scalar]]
    private let tables: [[Int]]
    private var matched: [Int]
    private let toolNames: Set<String>?
    private var call: [Int]?  // the tokens of the call under way, between its markers
    private var pending: [Unicode.Scalar] = []  // answer text not yet released (a stop string's prefix)
    public private(set) var stopped = false
    public private(set) var text = ""
    public private(set) var reasoningText = ""
    public private(set) var toolCalls: [ToolCall] = []

    /// `stop`: at most 4 strings of at most 1,000 characters (empty ones ignored).
    public init(tokenizer: any Tokenizer, stop: [String] = [], toolNames: Set<String>? = nil) throws {
        try Self.checkStop(stop)
        self.tokenizer = tokenizer
        content = StreamingDetokenizer(tokenizer: tokenizer)
        reasoning = StreamingDetokenizer(tokenizer: tokenizer)
        var seen = Set<String>()
        stops = stop.filter { !$0.isEmpty && seen.insert($0).inserted }.map { Array($0.unicodeScalars) }
        tables = stops.map(Self.prefixFunction)
        matched = Array(repeating: 0, count: stops.count)
        self.toolNames = toolNames
    }

    /// The one check of stop strings (the server's and the runtime's): a one-line error naming `stop`.
    public static func checkStop(_ stop: [String]) throws {
        if stop.count > maxStops {
            throw GemmaANEError(.input, "stop: \(stop.count) strings, more than the \(maxStops) allowed")
        }
        for (i, s) in stop.enumerated() where s.unicodeScalars.count > maxStopCharacters {
            throw GemmaANEError(.input, "stop[\(i)]: \(s.unicodeScalars.count) characters, more than the limit of \(maxStopCharacters)")
        }
    }

    public mutating func push(_ token: Int) -> OutputDelta {
        if stopped { return OutputDelta() }
        if call != nil {
            if token == Self.toolCallClose { return endCall(closed: true) }
            call!.append(token)
            return OutputDelta()
        }
        switch token {
        case Self.toolCallOpen:
            call = []
            return OutputDelta()
        case Self.channelOpen:
            inThought = true
            skipLabel = true
            return OutputDelta()
        case Self.channelClose:
            inThought = false
            return OutputDelta()
        default: break
        }
        if inThought {
            var piece = reasoning.push(token)
            if skipLabel {  // the channel name line: "thought\n"
                label += piece
                guard let newline = label.firstIndex(of: "\n") else { return OutputDelta() }
                piece = String(label[label.index(after: newline)...])
                skipLabel = false
                label = ""
            }
            reasoningText += piece
            return OutputDelta(reasoning: piece)
        }
        return OutputDelta(content: release(content.push(token)))
    }

    /// The answer's held-back tail at the generation's end (a call never closed is dropped).
    public mutating func finish() -> OutputDelta {
        if stopped { return OutputDelta() }
        if call != nil { _ = endCall(closed: false) }
        var tail = pending
        tail += Array(content.flush().unicodeScalars)
        pending = []
        for s in stops {
            if let at = Self.find(s, in: tail) {
                tail = Array(tail[..<at])
                stopped = true
            }
        }
        let out = Self.string(tail)
        text += out
        return OutputDelta(content: out)
    }

    private mutating func endCall(closed: Bool) -> OutputDelta {
        // decoded whole and with special tokens: <|"|>, which delimits strings, is one
        let body = tokenizer.decode(call ?? [], skipSpecialTokens: false)
        call = nil
        guard closed else { return OutputDelta() }  // cut short: no call, and its markup is no answer text either
        if let parsed = try? GemmaCall.parse(body), toolNames.map({ $0.contains(parsed.name) }) ?? true {
            let made = ToolCall(id: Self.callID(), name: parsed.name, arguments: parsed.arguments)
            toolCalls.append(made)
            return OutputDelta(toolCalls: [made])
        }
        return OutputDelta(content: release("<|tool_call>" + body + "<tool_call|>"))  // malformed: returned as text
    }

    static func callID() -> String {
        "call_" + UUID().uuidString.replacingOccurrences(of: "-", with: "").lowercased().prefix(24)
    }

    private mutating func release(_ piece: String) -> String {
        let scalars = Array(piece.unicodeScalars)
        pending += scalars
        if advance(scalars) {
            for s in stops {
                if let at = Self.find(s, in: pending) {
                    let out = Self.string(pending[..<at])
                    pending = []
                    stopped = true
                    text += out
                    return out
                }
            }
        }
        // the longest tail of the answer that some stop string starts with
        let hold = matched.max() ?? 0
        let cut = pending.count - hold
        let out = Self.string(pending[..<cut])
        pending.removeFirst(cut)
        text += out
        return out
    }

    /// Feed `piece` to each stop string's matcher (KMP: each character matched once); whether one occurs whole.
    private mutating func advance(_ piece: [Unicode.Scalar]) -> Bool {
        var found = false
        for n in stops.indices {
            let s = stops[n], table = tables[n]
            var k = matched[n]
            for c in piece {
                while k > 0 && c != s[k] { k = table[k - 1] }
                if c == s[k] { k += 1 }
                if k == s.count {
                    found = true
                    k = table[k - 1]
                }
            }
            matched[n] = k
        }
        return found
    }

    /// KMP's table: [k] is the length of the longest proper prefix of s[...k] that is also its suffix.
    static func prefixFunction(_ s: [Unicode.Scalar]) -> [Int] {
        var table = [Int](repeating: 0, count: s.count)
        var k = 0
        for i in s.indices.dropFirst() {
            while k > 0 && s[i] != s[k] { k = table[k - 1] }
            if s[i] == s[k] { k += 1 }
            table[i] = k
        }
        return table
    }

    static func find(_ needle: [Unicode.Scalar], in haystack: [Unicode.Scalar]) -> Int? {
        guard needle.count <= haystack.count else { return nil }
        for i in 0...(haystack.count - needle.count) where haystack[i..<(i + needle.count)].elementsEqual(needle) {
            return i
        }
        return nil
    }

    static func string<S: Sequence>(_ scalars: S) -> String where S.Element == Unicode.Scalar {
        var view = String.UnicodeScalarView()
        view.append(contentsOf: scalars)
        return String(view)
    }
}
