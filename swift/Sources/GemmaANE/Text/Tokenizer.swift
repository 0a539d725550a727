import Foundation

/// What the engine, the chat format and the output parser need of a tokenizer.
public protocol Tokenizer: Sendable {
    /// Ids in the vocabulary (the model's pieces and the added tokens).
    var vocabularySize: Int { get }
    /// The added tokens marked special: the control tokens a prompt's text must not spell by accident.
    var specialIDs: Set<Int> { get }
    /// `text`'s ids, every added token it spells counted as one (no BOS: the chat format writes it).
    func encode(_ text: String) -> [Int]
    /// The text of `ids`; special tokens left out when `skipSpecialTokens`.
    func decode(_ ids: [Int], skipSpecialTokens: Bool) -> String
    /// The id of a piece (a vocabulary entry or an added token), or nil.
    func id(of piece: String) -> Int?
    /// The piece an id stands for, or nil.
    func piece(of id: Int) -> String?
}

extension Tokenizer {
    public func decode(_ ids: [Int]) -> String { decode(ids, skipSpecialTokens: true) }
}

/// A Hugging Face `tokenizer.json` with a BPE model, as the `tokenizers` library runs it: GPT-2's byte-level
/// BPE (the tiny bundles') and SentencePiece-style BPE with byte fallback (Gemma's own: spaces as ▁, bytes
/// as <0xHH> pieces). Added tokens are cut out of the text first (leftmost, longest); the rest goes through the
/// normalizer, the pre-tokenizer and BPE's merges by rank. Anything else the file asks for is refused when it
/// loads, naming the field, rather than tokenized differently from the Python runtime.
public final class BPETokenizer: Tokenizer {
    public let vocabularySize: Int
    public let specialIDs: Set<Int>
    let vocab: PieceTable
    let pieces: [String?]
    /// (left id << 32 | right id) -> (rank << 32 | merged id)
    let merges: [UInt64: UInt64]
    let added: AddedTokens
    let normalizer: [Normalizer]
    let preTokenizer: [PreTokenizer]
    let decoder: [Decoder]
    let byteFallback: Bool
    let ignoreMerges: Bool
    let unknown: Int?
    let fuseUnknown: Bool
    /// <0xHH> piece ids by byte, when byte fallback is on.
    let byteIDs: [Int?]

    enum Normalizer { case replace(String, String), prepend(String) }
    enum SplitBehavior: String {
        case removed = "Removed", isolated = "Isolated", mergedWithPrevious = "MergedWithPrevious"
        case mergedWithNext = "MergedWithNext"
    }
    enum PreTokenizer {
        case byteLevel(addPrefixSpace: Bool, useRegex: Bool)
        case split(String, SplitBehavior)
        case metaspace(replacement: String, prepend: String, split: Bool)
    }
    enum Decoder { case byteLevel, replace(String, String), byteFallback, fuse, strip(Character, Int, Int) }

    /// Loads a bundle's tokenizer.json (`file` is the path errors name).
    public convenience init(contentsOf url: URL) throws {
        let data: Data
        do {
            data = try Data(contentsOf: url, options: .mappedIfSafe)
        } catch {
            throw GemmaANEError(.bundle, "\(url.path): unreadable tokenizer (\(error.localizedDescription))")
        }
        try self.init(json: data, file: url.path)
    }

    public init(json data: Data, file: String = "tokenizer.json") throws {
        let reader = try TokenizerFile(data: data, file: file)
        let model = try reader.object(reader.root, "model")
        let type = try reader.string(model, "type", in: "model")
        guard type == "BPE" else { throw reader.fail("model.type", "'\(type)' is not supported (BPE only)") }
        for field in ["continuing_subword_prefix", "end_of_word_suffix"] where (model[field] ?? .null) != .null {
            throw reader.fail("model.\(field)", "is not supported")
        }
        if let dropout = model["dropout"], dropout != .null, dropout.number != 0 {
            throw reader.fail("model.dropout", "is not supported (decoding must be deterministic)")
        }
        guard let vocabMembers = model["vocab"]?.members else {
            throw reader.fail("model.vocab", "expected an object of pieces to ids")
        }
        var vocab = PieceTable(capacity: vocabMembers.count)
        var top = -1
        for member in vocabMembers {
            guard let id = member.value.int, id >= 0, id < 1 << 24 else {
                throw reader.fail("model.vocab", "'\(member.key.prefix(40))': \(member.value.pythonText.prefix(40)) is not a token id")
            }
            vocab.insert(member.key.utf8, id: id)
            top = max(top, id)
        }
        let addedList = try AddedTokens.read(reader)
        for token in addedList { top = max(top, token.id) }
        var pieces = [String?](repeating: nil, count: top + 1)
        for member in vocabMembers { pieces[member.value.int!] = member.key }
        for token in addedList { pieces[token.id] = token.content }

        guard let mergeList = model["merges"]?.array else { throw reader.fail("model.merges", "expected an array") }
        var merges = [UInt64: UInt64](minimumCapacity: mergeList.count)
        for (rank, entry) in mergeList.enumerated() {
            var pair = [String]()
            if let text = entry.string {
                // split on the first space scalar: by Character, " \u{301}" (a space and a combining mark) is one
                let scalars = text.unicodeScalars
                if let space = scalars.firstIndex(of: " ") {
                    pair = [String(scalars[..<space]), String(scalars[scalars.index(after: space)...])]
                }
            } else if let list = entry.array {
                pair = list.compactMap(\.string)
            }
            guard pair.count == 2, let left = vocab[pair[0].utf8], let right = vocab[pair[1].utf8],
                let merged = vocab.joined(pair[0].utf8, pair[1].utf8)
            else {
                throw reader.fail(
                    "model.merges[\(rank)]", "\(entry.pythonText.prefix(60)) does not join two pieces of the vocabulary into one")
            }
            let key = UInt64(left) << 32 | UInt64(right)
            if merges[key] == nil { merges[key] = UInt64(rank) << 32 | UInt64(merged) }
        }
        self.vocab = vocab
        self.pieces = pieces
        self.merges = merges
        vocabularySize = top + 1
        added = AddedTokens(addedList)
        specialIDs = Set(addedList.filter(\.special).map(\.id))
        byteFallback = model["byte_fallback"]?.bool ?? false
        ignoreMerges = model["ignore_merges"]?.bool ?? false
        fuseUnknown = model["fuse_unk"]?.bool ?? false
        let addedIDs = added.ids
        unknown = model["unk_token"]?.string.flatMap { addedIDs[$0] ?? vocab[$0.utf8] }
        byteIDs = (0..<256).map { vocab[String(format: "<0x%02X>", $0).utf8] }
        normalizer = try Self.readNormalizer(reader)
        preTokenizer = try Self.readPreTokenizer(reader)
        decoder = try Self.readDecoder(reader)
    }

    // MARK: lookups

    public func id(of piece: String) -> Int? { added.ids[piece] ?? vocab[piece.utf8] }

    public func piece(of id: Int) -> String? { id >= 0 && id < pieces.count ? pieces[id] : nil }

    // MARK: encoding

    public func encode(_ text: String) -> [Int] { encode(text, matchSpecial: true) }

    /// `text`'s ids; with `matchSpecial` false, special tokens it spells are text like any other (the
    /// `tokenizers` library's `encode_special_tokens`), non-special added tokens still one id each.
    public func encode(_ text: String, matchSpecial: Bool) -> [Int] {
        var ids = [Int]()
        var first = true
        for segment in added.split(text, matchSpecial: matchSpecial) {
            switch segment {
            case .token(let id): ids.append(id)
            case .text(let piece): encodeSegment(piece, first: first, into: &ids)
            }
            first = false
        }
        return ids
    }

    /// The spans of `text` (UTF-8 offsets) where it spells a special token, as the full encode matches them.
    func specialSpans(_ text: String) -> [(Int, Int)] {
        added.matches(Array(text.utf8), matchSpecial: true).filter { specialIDs.contains($0.id) }.map { ($0.start, $0.end) }
    }

    private func encodeSegment(_ segment: String, first: Bool, into ids: inout [Int]) {
        var text = segment
        for step in normalizer {
            switch step {
            case .replace(let a, let b): text = ByteText.replacing(text, a, with: b)
            case .prepend(let p): if !text.isEmpty { text = p + text }
            }
        }
        var words = [text]
        for step in preTokenizer {
            words = words.flatMap { preTokenize($0, step, first: first) }
        }
        for word in words where !word.isEmpty { bpe(word, into: &ids) }
    }

    private func preTokenize(_ text: String, _ step: PreTokenizer, first: Bool) -> [String] {
        switch step {
        case .byteLevel(let addPrefixSpace, let useRegex):
            let spaced = addPrefixSpace && !ByteText.hasPrefix(text, " ") ? " " + text : text
            let words = useRegex ? ByteLevel.split(spaced) : [spaced]
            return words.map(ByteLevel.encode)
        case .split(let delimiter, let behavior):
            return Self.split(text, on: delimiter, behavior)
        case .metaspace(let replacement, let prepend, let split):
            var t = ByteText.replacing(text, " ", with: replacement)
            if (prepend == "always" || (prepend == "first" && first)) && !ByteText.hasPrefix(t, replacement) {
                t = replacement + t
            }
            return split ? Self.split(t, on: replacement, .mergedWithNext) : [t]
        }
    }

    static func split(_ text: String, on delimiter: String, _ behavior: SplitBehavior) -> [String] {
        let parts = ByteText.split(text, on: delimiter)
        guard parts.count > 1 else { return [text] }
        var pieces = [String]()
        for (i, part) in parts.enumerated() {
            let last = i == parts.count - 1
            switch behavior {
            case .removed: pieces.append(part)
            case .isolated: pieces += last ? [part] : [part, delimiter]
            case .mergedWithPrevious: pieces.append(last ? part : part + delimiter)
            case .mergedWithNext: pieces.append(i == 0 ? part : delimiter + part)
            }
        }
        return pieces.filter { !$0.isEmpty }
    }

    /// BPE on one word: its characters (or their <0xHH> bytes, or the unknown token), then the merges in rank
    /// order, leftmost first among equals, as the `tokenizers` library's heap applies them.
    private func bpe(_ word: String, into ids: inout [Int]) {
        if ignoreMerges, let id = vocab[word.utf8] {
            ids.append(id)
            return
        }
        var symbols = [Int]()
        var lastWasUnknown = false
        for scalar in word.unicodeScalars {
            if let id = vocab[String(scalar).utf8] {
                symbols.append(id)
                lastWasUnknown = false
            } else if byteFallback, case let bytes = Array(String(scalar).utf8), bytes.allSatisfy({ byteIDs[Int($0)] != nil }) {
                symbols += bytes.map { byteIDs[Int($0)]! }
                lastWasUnknown = false
            } else if let unknown {
                if !(fuseUnknown && lastWasUnknown) { symbols.append(unknown) }
                lastWasUnknown = true
            }
        }
        if symbols.count > 1 { symbols = merge(symbols) }
        ids += symbols
    }

    private func merge(_ start: [Int]) -> [Int] {
        var ids = start
        let n = ids.count
        var next = Array(1...n)  // n: none
        var prev = Array(-1..<(n - 1))
        var alive = [Bool](repeating: true, count: n)
        var heap = MergeHeap()
        func push(_ i: Int) {
            let j = next[i]
            guard j < n, let m = merges[UInt64(ids[i]) << 32 | UInt64(ids[j])] else { return }
            heap.push(rank: Int(m >> 32), position: i, merged: Int(m & 0xFFFF_FFFF))
        }
        for i in 0..<(n - 1) { push(i) }
        while let top = heap.pop() {
            let i = top.position
            guard alive[i], next[i] < n else { continue }
            let j = next[i]
            guard let m = merges[UInt64(ids[i]) << 32 | UInt64(ids[j])], Int(m & 0xFFFF_FFFF) == top.merged else { continue }
            ids[i] = top.merged
            alive[j] = false
            next[i] = next[j]
            if next[j] < n { prev[next[j]] = i }
            if prev[i] >= 0 { push(prev[i]) }
            push(i)
        }
        return (0..<n).filter { alive[$0] }.map { ids[$0] }
    }

    // MARK: decoding

    public func decode(_ ids: [Int], skipSpecialTokens: Bool) -> String {
        var tokens = [String]()
        tokens.reserveCapacity(ids.count)
        for id in ids {
            guard let piece = piece(of: id) else { continue }
            if skipSpecialTokens && specialIDs.contains(id) { continue }
            tokens.append(piece)
        }
        if decoder.isEmpty { return tokens.joined(separator: " ") }
        for step in decoder { tokens = Self.decode(tokens, step) }
        return tokens.joined()
    }

    private static func decode(_ tokens: [String], _ step: Decoder) -> [String] {
        switch step {
        case .byteLevel:
            var bytes = [UInt8]()
            for token in tokens {
                if let own = ByteLevel.decode(token) { bytes += own } else { bytes += Array(token.utf8) }
            }
            return [String(decoding: bytes, as: UTF8.self)]
        case .replace(let a, let b):
            return tokens.map { ByteText.replacing($0, a, with: b) }
        case .fuse:
            return [tokens.joined()]
        case .strip(let content, let start, let stop):
            return tokens.map { token in
                var chars = Array(token)
                var head = 0
                while head < start, head < chars.count, chars[head] == content { head += 1 }
                chars.removeFirst(head)
                var tail = 0
                while tail < stop, tail < chars.count, chars[chars.count - 1 - tail] == content { tail += 1 }
                chars.removeLast(tail)
                return String(chars)
            }
        case .byteFallback:
            var out = [String]()
            var pending = [UInt8]()
            func flush() {
                guard !pending.isEmpty else { return }
                if let text = String(validatingUTF8Bytes: pending) {
                    out.append(text)
                } else {
                    out += Array(repeating: "\u{FFFD}", count: pending.count)
                }
                pending = []
            }
            for token in tokens {
                if let byte = Self.fallbackByte(token) {
                    pending.append(byte)
                } else {
                    flush()
                    out.append(token)
                }
            }
            flush()
            return out
        }
    }

    /// The byte a `<0xHH>` piece stands for.
    static func fallbackByte(_ token: String) -> UInt8? {
        let u = Array(token.utf8)
        guard u.count == 6, u[0] == 60, u[1] == 48, u[2] == 120, u[5] == 62 else { return nil }
        return UInt8(String(decoding: u[3...4], as: UTF8.self), radix: 16)
    }
}

extension String {
    /// The text of `bytes` if they are valid UTF-8 (nil otherwise, where `String(decoding:)` would substitute).
    init?(validatingUTF8Bytes bytes: [UInt8]) {
        var iterator = bytes.makeIterator()
        var decoder = UTF8()
        var scalars = String.UnicodeScalarView()
        while true {
            switch decoder.decode(&iterator) {
            case .scalarValue(let s): scalars.append(s)
            case .emptyInput:
                self = String(scalars)
                return
            case .error: return nil
            }
        }
    }
}

/// A binary heap of candidate merges, smallest rank first, then leftmost.
struct MergeHeap {
    struct Entry {
        let rank: Int
        let position: Int
        let merged: Int
        func before(_ other: Entry) -> Bool { rank != other.rank ? rank < other.rank : position < other.position }
    }

    private var items = [Entry]()

    mutating func push(rank: Int, position: Int, merged: Int) {
        items.append(Entry(rank: rank, position: position, merged: merged))
        var i = items.count - 1
        while i > 0 {
            let parent = (i - 1) / 2
            guard items[i].before(items[parent]) else { break }
            items.swapAt(i, parent)
            i = parent
        }
    }

    mutating func pop() -> Entry? {
        guard let top = items.first else { return nil }
        let last = items.removeLast()
        if !items.isEmpty {
            items[0] = last
            var i = 0
            while true {
                let l = 2 * i + 1, r = l + 1
                var best = i
                if l < items.count, items[l].before(items[best]) { best = l }
                if r < items.count, items[r].before(items[best]) { best = r }
                if best == i { break }
                items.swapAt(i, best)
                i = best
            }
        }
        return top
    }
}
