import Foundation

/// tokenizer.json decoded, with errors that name the file and the field (`tokenizer.json: model.type: ...`).
struct TokenizerFile {
    let root: JSONValue
    let file: String

    init(data: Data, file: String) throws {
        self.file = file
        // JSON is UTF-8: bytes that are not would become U+FFFD inside pieces and tokenize silently wrong
        guard String(validating: data, as: UTF8.self) != nil else {
            throw GemmaANEError(.bundle, "\(file): not valid JSON (not UTF-8 text)")
        }
        let value: JSONValue
        do {
            value = try data.withUnsafeBytes { try JSONReader.parse($0.bindMemory(to: UInt8.self)) }
        } catch let failure as JSONReader.Failure {
            throw GemmaANEError(.bundle, "\(file): not valid JSON (\(failure.why) at byte \(failure.offset))")
        }
        guard value.members != nil else { throw GemmaANEError(.bundle, "\(file): expected a JSON object") }
        root = value
    }

    func fail(_ field: String, _ why: String) -> GemmaANEError {
        GemmaANEError(.bundle, "\(file): \(field): \(why)")
    }

    func object(_ parent: JSONValue, _ key: String) throws -> JSONValue {
        guard let value = parent[key], value.members != nil else { throw fail(key, "expected an object") }
        return value
    }

    func string(_ parent: JSONValue, _ key: String, in path: String) throws -> String {
        guard let value = parent[key]?.string else { throw fail("\(path).\(key)", "expected a string") }
        return value
    }

    /// A component (normalizer, pre_tokenizer, decoder): nil, one object, or a Sequence's list, flattened.
    func steps(_ key: String) throws -> [(path: String, fields: JSONValue, type: String)] {
        guard let value = root[key], value != .null else { return [] }
        guard value.members != nil else { throw fail(key, "expected an object or null") }
        return try flatten(value, key)
    }

    private func flatten(_ object: JSONValue, _ path: String) throws -> [(path: String, fields: JSONValue, type: String)] {
        let type = try string(object, "type", in: path)
        guard type == "Sequence" else { return [(path, object, type)] }
        let listKey = ["normalizers", "pretokenizers", "decoders"].first { object[$0] != nil } ?? "decoders"
        guard let list = object[listKey]?.array, list.allSatisfy({ $0.members != nil }) else {
            throw fail("\(path).\(listKey)", "expected an array of objects")
        }
        return try list.enumerated().flatMap { try flatten($1, "\(path).\(listKey)[\($0)]") }
    }

    /// A Replace's or Split's pattern: a plain string (a regex is not supported).
    func pattern(_ fields: JSONValue, _ path: String) throws -> String {
        guard let text = fields["pattern"]?["String"]?.string, !text.isEmpty else {
            throw fail("\(path).pattern", "only a non-empty String pattern is supported (no Regex)")
        }
        return text
    }
}

extension BPETokenizer {
    static func readNormalizer(_ reader: TokenizerFile) throws -> [Normalizer] {
        try reader.steps("normalizer").map { path, fields, type in
            switch type {
            case "Replace":
                return .replace(try reader.pattern(fields, path), try reader.string(fields, "content", in: path))
            case "Prepend":
                return .prepend(try reader.string(fields, "prepend", in: path))
            default:
                throw reader.fail("\(path).type", "'\(type)' is not supported (Replace, Prepend)")
            }
        }
    }

    static func readPreTokenizer(_ reader: TokenizerFile) throws -> [PreTokenizer] {
        try reader.steps("pre_tokenizer").map { path, fields, type in
            switch type {
            case "ByteLevel":
                return .byteLevel(
                    addPrefixSpace: fields["add_prefix_space"]?.bool ?? true, useRegex: fields["use_regex"]?.bool ?? true)
            case "Split":
                let behavior = try reader.string(fields, "behavior", in: path)
                guard let kind = SplitBehavior(rawValue: behavior) else {
                    throw reader.fail("\(path).behavior", "'\(behavior)' is not supported")
                }
                if fields["invert"]?.bool == true { throw reader.fail("\(path).invert", "is not supported") }
                return .split(try reader.pattern(fields, path), kind)
            case "Metaspace":
                let scheme = fields["prepend_scheme"]?.string ?? (fields["add_prefix_space"]?.bool == false ? "never" : "always")
                guard ["always", "first", "never"].contains(scheme) else {
                    throw reader.fail("\(path).prepend_scheme", "'\(scheme)' is not supported")
                }
                return .metaspace(
                    replacement: try reader.string(fields, "replacement", in: path), prepend: scheme,
                    split: fields["split"]?.bool ?? true)
            default:
                throw reader.fail("\(path).type", "'\(type)' is not supported (ByteLevel, Split, Metaspace)")
            }
        }
    }

    static func readDecoder(_ reader: TokenizerFile) throws -> [Decoder] {
        try reader.steps("decoder").map { path, fields, type in
            switch type {
            case "ByteLevel": return .byteLevel
            case "Replace": return .replace(try reader.pattern(fields, path), try reader.string(fields, "content", in: path))
            case "ByteFallback": return .byteFallback
            case "Fuse": return .fuse
            case "Strip":
                let content = try reader.string(fields, "content", in: path)
                guard content.count == 1, let start = fields["start"]?.int, let stop = fields["stop"]?.int else {
                    throw reader.fail(path, "expected one content character and start and stop counts")
                }
                return .strip(content.first!, start, stop)
            default:
                throw reader.fail("\(path).type", "'\(type)' is not supported (ByteLevel, Replace, ByteFallback, Fuse, Strip)")
            }
        }
    }
}

/// The added tokens (the control tokens and any others): cut out of the text before the model sees it, at the
/// leftmost place one starts, the longest there, as the `tokenizers` library's matcher does.
struct AddedTokens: Sendable {
    struct Token: Sendable {
        let id: Int
        let content: String
        let special: Bool
    }

    enum Segment { case text(String), token(Int) }

    let ids: [String: Int]
    private let tokens: [Token]
    /// A byte trie: node -> (byte -> node); a node's token index where one ends.
    private let children: [[UInt8: Int32]]
    private let ends: [Int32]

    static func read(_ reader: TokenizerFile) throws -> [Token] {
        guard let list = reader.root["added_tokens"], list != .null else { return [] }
        guard let items = list.array else { throw reader.fail("added_tokens", "expected an array of objects") }
        return try items.enumerated().map { i, item in
            guard let id = item["id"]?.int, id >= 0, id < 1 << 24, let content = item["content"]?.string, !content.isEmpty else {
                throw reader.fail("added_tokens[\(i)]", "expected an id and a non-empty content")
            }
            for flag in ["single_word", "lstrip", "rstrip"] where item[flag]?.bool == true {
                throw reader.fail("added_tokens[\(i)].\(flag)", "is not supported")
            }
            return Token(id: id, content: content, special: item["special"]?.bool ?? false)
        }
    }

    init(_ tokens: [Token]) {
        self.tokens = tokens
        ids = Dictionary(tokens.map { ($0.content, $0.id) }, uniquingKeysWith: { _, last in last })
        var children: [[UInt8: Int32]] = [[:]]
        var ends: [Int32] = [-1]
        for (index, token) in tokens.enumerated() {
            var node = 0
            for byte in token.content.utf8 {
                if let child = children[node][byte] {
                    node = Int(child)
                } else {
                    children.append([:])
                    ends.append(-1)
                    children[node][byte] = Int32(children.count - 1)
                    node = children.count - 1
                }
            }
            ends[node] = Int32(index)
        }
        self.children = children
        self.ends = ends
    }

    /// Every match in `bytes`: (start, end, id), left to right, none overlapping.
    func matches(_ bytes: [UInt8], matchSpecial: Bool) -> [(start: Int, end: Int, id: Int)] {
        var out = [(start: Int, end: Int, id: Int)]()
        guard !tokens.isEmpty else { return out }
        var i = 0
        while i < bytes.count {
            var node = 0, j = i
            var best: (end: Int, token: Int)?
            while j < bytes.count, let child = children[node][bytes[j]] {
                node = Int(child)
                j += 1
                let end = ends[node]
                if end >= 0, matchSpecial || !tokens[Int(end)].special { best = (j, Int(end)) }
            }
            if let best {
                out.append((i, best.end, tokens[best.token].id))
                i = best.end
            } else {
                i += 1
            }
        }
        return out
    }

    func split(_ text: String, matchSpecial: Bool) -> [Segment] {
        let bytes = Array(text.utf8)
        var out = [Segment]()
        var start = 0
        for m in matches(bytes, matchSpecial: matchSpecial) {
            if m.start > start { out.append(.text(String(decoding: bytes[start..<m.start], as: UTF8.self))) }
            out.append(.token(m.id))
            start = m.end
        }
        if start < bytes.count { out.append(.text(String(decoding: bytes[start...], as: UTF8.self))) }
        return out
    }
}
