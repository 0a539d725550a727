/// Text as tokens arrive, never half a character, in O(1) per token: the Python runtime's `Detokenizer`
/// (gemma_ane/runtime/chat.py). Decodes a short window, the tokens since the last release plus those before
/// them, and emits what the new tokens add to that prefix's text (a slice decoded alone can differ at its start:
/// a SentencePiece word's space); text that ends in U+FFFD, a character still incomplete, is held.
public struct StreamingDetokenizer: Sendable {
    private let tokenizer: any Tokenizer
    private var tokens: [Int] = []
    private var prefix = 0  // window start
    private var read = 0  // end of the released tokens

    public init(tokenizer: any Tokenizer) {
        self.tokenizer = tokenizer
    }

    private func decode(_ slice: ArraySlice<Int>) -> String {
        tokenizer.decode(Array(slice), skipSpecialTokens: true)
    }

    /// Push one token; the text it completes (often empty).
    public mutating func push(_ token: Int) -> String {
        tokens.append(token)
        return release(final: false)
    }

    /// The text still held, at the generation's end. The first bytes of a character the generation ended inside
    /// (at most 3) are dropped, not emitted as U+FFFD; bytes that were never a character stay U+FFFD.
    public mutating func flush() -> String {
        if decode(tokens[prefix...]).unicodeScalars.last == "\u{FFFD}" {
            for k in stride(from: 1, through: min(3, tokens.count - read), by: 1)
            where decode(tokens[prefix..<(tokens.count - k)]).unicodeScalars.last != "\u{FFFD}" {
                tokens.removeLast(k)
                break
            }
        }
        return release(final: true)
    }

    private mutating func release(final: Bool) -> String {
        let before = decode(tokens[prefix..<read])
        let text = decode(tokens[prefix...])
        // Python compares lengths in code points and slices by them
        let beforeCount = before.unicodeScalars.count, textCount = text.unicodeScalars.count
        if (text.unicodeScalars.last == "\u{FFFD}" && !final) || textCount <= beforeCount { return "" }
        prefix = read
        read = tokens.count
        var out = String.UnicodeScalarView()
        out.append(contentsOf: text.unicodeScalars.dropFirst(beforeCount))
        return String(out)
    }
}
