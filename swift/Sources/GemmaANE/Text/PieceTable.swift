/// The vocabulary's pieces -> ids, keyed by their UTF-8 bytes. Not a `[String: Int]`: Swift compares strings by
/// canonical equivalence, which would take "Å" (U+00C5) and the Ångström sign (U+212B), distinct pieces to the
/// tokenizer, for one key, and normalising every key to hash it costs seconds at 262,144 pieces. Open addressing
/// over one byte buffer, FNV-1a hashes.
struct PieceTable: Sendable {
    private var bytes: [UInt8] = []
    private var starts: [Int] = []
    private var ids: [Int] = []
    private var slots: [Int32]  // an entry's index, or -1
    private let mask: Int

    init(capacity: Int) {
        var size = 16
        while size < 2 * capacity { size <<= 1 }
        slots = [Int32](repeating: -1, count: size)
        mask = size - 1
        starts = [0]
    }

    // A piece is looked up as one run of bytes or two (a merge's halves), never copied into a key.
    private static func hash<C: Sequence>(_ left: C, _ right: C?) -> Int where C.Element == UInt8 {
        var h: UInt64 = 0xcbf2_9ce4_8422_2325
        for byte in left { h = (h ^ UInt64(byte)) &* 0x100_0000_01b3 }
        if let right {
            for byte in right { h = (h ^ UInt64(byte)) &* 0x100_0000_01b3 }
        }
        return Int(truncatingIfNeeded: h)
    }

    private func matches<C: Collection>(_ entry: Int, _ left: C, _ right: C?) -> Bool where C.Element == UInt8 {
        var i = starts[entry]
        let end = starts[entry + 1]
        guard end - i == left.count + (right?.count ?? 0) else { return false }
        for byte in left {
            guard bytes[i] == byte else { return false }
            i += 1
        }
        if let right {
            for byte in right {
                guard bytes[i] == byte else { return false }
                i += 1
            }
        }
        return true
    }

    private func find<C: Collection>(_ left: C, _ right: C?) -> (slot: Int, entry: Int?) where C.Element == UInt8 {
        var slot = Self.hash(left, right) & mask
        while slots[slot] >= 0 {
            let entry = Int(slots[slot])
            if matches(entry, left, right) { return (slot, entry) }
            slot = (slot + 1) & mask
        }
        return (slot, nil)
    }

    /// Sets a piece's id (a later one for the same bytes wins, as a JSON object's repeated key).
    mutating func insert<C: Collection>(_ piece: C, id: Int) where C.Element == UInt8 {
        let (slot, entry) = find(piece, nil as C?)
        if let entry {
            ids[entry] = id
            return
        }
        precondition(ids.count < slots.count / 2, "PieceTable sized for fewer pieces")
        bytes.append(contentsOf: piece)
        starts.append(bytes.count)
        ids.append(id)
        slots[slot] = Int32(ids.count - 1)
    }

    subscript<C: Collection>(_ piece: C) -> Int? where C.Element == UInt8 {
        find(piece, nil as C?).entry.map { ids[$0] }
    }

    /// The id of the piece spelled by `left` then `right`, without building it.
    func joined<C: Collection>(_ left: C, _ right: C) -> Int? where C.Element == UInt8 {
        find(left, right).entry.map { ids[$0] }
    }
}
