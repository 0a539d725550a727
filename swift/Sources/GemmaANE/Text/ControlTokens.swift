/// Keeps text that spells a control token text (the Python runtime's `ControlTokens`, gemma_ane/runtime/tokens.py):
/// a user who types "<turn|>" must not end their turn. `escapeControlTokens` breaks every spelling in a piece of text
/// with `mark`, a character found nowhere else; `encodePrompt` then takes the control tokens of a rendered prompt
/// as they are, and encodes each stretch between them that holds a mark as plain text, mark removed, matching no
/// special token: the text keeps exactly the ids it would have had, were it not a control token's name.
extension BPETokenizer {
    /// `text` with `mark` after the first character of every special token it spells (again, while breaking one
    /// reveals another inside it).
    public func escapeControlTokens(_ text: String, mark: Unicode.Scalar) -> String {
        var text = text
        while true {
            let bytes = Array(text.utf8)
            // a one-character control token cannot be broken this way (Gemma has none)
            let cuts = specialSpans(text).compactMap { start, end -> Int? in
                let first = start + Self.scalarLength(bytes[start])
                return first < end ? first : nil
            }
            if cuts.isEmpty { return text }
            var out = [UInt8]()
            var at = 0
            for cut in cuts {
                out += bytes[at..<cut]
                out += Array(String(mark).utf8)
                at = cut
            }
            out += bytes[at...]
            text = String(decoding: out, as: UTF8.self)
        }
    }

    /// The ids of `text`, a prompt rendered from escaped pieces: its control tokens, and the stretches between
    /// them, those holding `mark` as plain text.
    public func encodePrompt(_ text: String, mark: Unicode.Scalar) -> [Int] {
        guard text.unicodeScalars.contains(mark) else { return encode(text) }
        var ids = [Int]()
        var stretch = ""
        func flush() {
            guard !stretch.isEmpty else { return }
            if stretch.unicodeScalars.contains(mark) {
                var plain = String.UnicodeScalarView()
                plain.append(contentsOf: stretch.unicodeScalars.filter { $0 != mark })
                ids += encode(String(plain), matchSpecial: false)
            } else {
                ids += encode(stretch)
            }
            stretch = ""
        }
        for segment in added.split(text, matchSpecial: true) {
            switch segment {
            case .token(let id) where specialIDs.contains(id):
                flush()
                ids.append(id)
            case .token(let id): stretch += piece(of: id) ?? ""
            case .text(let piece): stretch += piece
            }
        }
        flush()
        return ids
    }

    static func scalarLength(_ lead: UInt8) -> Int {
        lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4
    }
}

/// Unicode's noncharacters, kept for a program's internal use: a mark that no text should hold.
let noncharacters: [Unicode.Scalar] =
    (0xFDD0..<0xFDF0).map { Unicode.Scalar($0)! }
    + (0..<17).flatMap { plane in [0xFFFE, 0xFFFF].map { Unicode.Scalar(UInt32(plane) << 16 | $0)! } }

/// A noncharacter that none of `texts` holds (nil: they hold every one).
func unusedMark(_ texts: [String]) -> Unicode.Scalar? {
    var used = Set<Unicode.Scalar>()
    for text in texts {
        for scalar in text.unicodeScalars where scalar.properties.isNoncharacterCodePoint { used.insert(scalar) }
    }
    return noncharacters.first { !used.contains($0) }
}
